"""The training data of ``composer-train``: a local dataset file, an environment (``--env``) or the embedded task,
checked before the model loads (each refusal one line: :class:`~composer_trl.lifecycle.DataError`, exit 3, or
:class:`~composer_trl.lifecycle.UsageError`, exit 2)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from composer_trl.lifecycle import DataError, EnvFault, UsageError
from composer_trl.models import tokenizer_and_context
from composer_trl.recipe import PAIR_COLUMNS, Recipe

DATA_KINDS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_dataset_checked(recipe: Recipe, *, need: int, n_rows: int) -> Any:
    """The training set; raises :class:`DataError` unless it has a ``prompt`` column and ``>= need`` rows."""
    from datasets import Dataset, load_dataset

    if recipe.dataset is None:
        from composer_core.tasks.digit_reversal import make_dataset_rows

        return Dataset.from_list(make_dataset_rows(n_rows, seed=recipe.seed))
    path = Path(recipe.dataset)
    flag = f"--dataset_name {recipe.dataset!r}"
    if not path.is_file() or path.suffix.lower() not in DATA_KINDS:
        raise DataError(f"{flag} must be an existing .json/.jsonl/.parquet/.csv file.")
    if path.stat().st_size == 0 or (path.suffix.lower() != ".parquet" and not path.read_text().strip()):
        raise DataError(f"{flag} is empty (0 rows); it needs at least {need} rows with a `prompt` column.")
    if path.suffix.lower() == ".jsonl":
        _check_jsonl(path, flag)
    try:
        ds = load_dataset(DATA_KINDS[path.suffix.lower()], data_files=str(path), split="train")
    except Exception as e:  # datasets raises many kinds; all mean "unreadable file"
        root = e.__cause__ or e.__context__ or e
        first = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
        raise DataError(f"{flag} could not be read ({type(e).__name__}: {first}).") from e
    if "prompt" not in ds.column_names:
        raise DataError(f"{flag} needs a `prompt` column; it has {ds.column_names}.")
    if len(ds) < need:
        raise DataError(
            f"{flag} has {len(ds)} rows but one optimiser step needs {need} prompts (generation batch / "
            "num_generations); add rows or lower --per_device_train_batch_size."
        )
    return ds


def load_env_checked(
    recipe: Recipe, trainer: Mapping[str, Any], *, need: int, n_rows: int
) -> tuple[Any, Any]:
    """``(environment, dataset)`` of ``--env``: rows, rewards and hints come from the environment.

    Bad spec or missing extra: :class:`UsageError` (exit 2); the environment faulting (server down, ...):
    :class:`EnvFault` (exit 4); too few tasks: :class:`DataError` (exit 3); channel 3 set on in ``trainer`` (the
    trainer options) but the environment gives no reference answers: :class:`UsageError`.
    """
    from composer_core.envs import EnvError, env_dataset_rows, load_env
    from datasets import Dataset

    spec = str(recipe.env)
    kw: dict[str, Any] = {"n_tasks": n_rows, "seed": recipe.seed} if spec == "digit-reversal" else {}
    try:
        env = load_env(spec, **kw)
        rows = env_dataset_rows(env, "train", n_rows)
    except EnvError as e:
        raise EnvFault(f"--env {spec!r}: {e}") from e
    except (ValueError, ImportError) as e:
        raise UsageError(str(e)) from e
    if len(rows) < need:
        raise DataError(
            f"--env {spec!r} has {len(rows)} training tasks but one optimiser step needs {need} prompts "
            "(generation batch / num_generations); lower --per_device_train_batch_size."
        )
    if trainer.get("replay_pairs") == "on_policy":  # the student's failures are the rejected side
        rows = [{k: v for k, v in r.items() if k != "rejected"} for r in rows]
    elif trainer.get("beta_replay") and not set(rows[0]) >= PAIR_COLUMNS:  # channel 3 set on
        raise UsageError(
            f"--env {spec!r} gives no reference and wrong answers (channel 3's chosen/rejected); "
            "pass --beta_replay 0 to train without channel 3."
        )
    return env, Dataset.from_list(rows)


def _check_jsonl(path: Path, flag: str) -> None:
    with path.open() as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError as e:
                    raise DataError(f"{flag} could not be read: line {i} is not JSON ({e}).") from e


def check_prompt_lengths(recipe: Recipe, config: Any, dataset: Any, flag: str) -> None:
    """Refuse (:class:`UsageError`, exit 2) the first prompt whose tokens + ``max_completion_length`` exceed the
    model's context, before the model loads: TRL 1.16 has no prompt truncation and would generate over it
    (minutes or an out-of-memory error for a 100,000-token prompt). Tokenized as ``GRPOTrainer`` tokenizes."""
    from composer_trl.guards import overlong_prompt, prompt_lengths, prompt_too_long_message

    found = tokenizer_and_context(recipe, config)
    if found is None or "prompt" not in dataset.column_names:
        return
    tok, context = found
    m = int(config.max_completion_length or 0)
    kwargs = config.chat_template_kwargs if isinstance(config.chat_template_kwargs, dict) else {}
    for start in range(0, len(dataset), 1024):
        try:
            lengths = prompt_lengths(tok, list(dataset[start : start + 1024]["prompt"]), kwargs)
        except Exception:  # prompts this tokenizer cannot render: GRPOTrainer reports them as it always has
            return
        i = overlong_prompt(lengths, m, context)
        if i is not None:
            raise UsageError(prompt_too_long_message(f"{flag} row {start + i}", lengths[i], m, context))
