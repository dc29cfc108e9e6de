"""``composer-train``: train with composer's 3-channel objective inside TRL, in one command.

``--env`` takes the prompts, rewards and hints from an environment instead (:mod:`composer_core.envs`:
``digit-reversal``, ``openenv:<url>``, ``verifiers:<module>``; its reference answers are channel 3's
``chosen``). With no arguments it builds a tiny Qwen2 (random init, character tokenizer, no download) and trains it
on the embedded digit-reversal task (:mod:`composer_core.tasks.digit_reversal`): reward from the verifier, hints from the
verifier's feedback (channel 2), oracle answers as teacher traces (channel 3). It shows a progress bar
(reward and each channel's loss), writes ``metrics-composer.jsonl``, a PNG plot, ``summary.json`` and the
trained model, and prints where they are. The comparisons are benchmarks (``packages/composer-trl/bench/compare_*.py``).

Arguments follow TRL's conventions: ``transformers.HfArgumentParser`` over
:class:`~composer_trl.args.ComposerScriptArguments`, :class:`~composer_trl.args.ComposerModelConfig` (TRL's
``ModelConfig``: ``--use_peft --lora_r 8``) and :class:`~composer_trl.ComposerGRPOConfig`, so every
config field is a flag (``--alpha_sdpo 0.5 --learning_rate 1e-6``) and ``--config`` takes the flat YAML
``trl grpo --config`` takes (or composer's TOML/YAML recipe with a ``[trainer]`` table). Values given on
the command line win over the file, which wins over the defaults of :mod:`composer_trl.recipe`.
Exit codes: see :mod:`composer_trl.lifecycle`.
"""

from __future__ import annotations

import difflib
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NoReturn

from composer_trl import preflight
from composer_trl.guards import RewardFunctionError
from composer_trl.lifecycle import (
    DataError,
    EnvFault,
    RewardFault,
    UsageError,
    checkpoint_step,
    discard_failed_run,
    dumps,
    prepare_output_dir,
    resolve_checkpoint,
)
from composer_trl.models import PACKAGED
from composer_trl.recipe import PAIR_COLUMNS, Recipe, choose_channels, import_callable, read_config_file

SCRIPT_TO_RECIPE = {
    "model_name_or_path": "model",
    "dataset_name": "dataset",
    "reward_funcs": "reward",
    "hint_fn": "hint_fn",
    "env": "env",
    "steps": "steps",
    "max_steps": "steps",
    "seed": "seed",
    "output_dir": "output_dir",
    "trust_remote_code": "trust_remote_code",
    "eval_holdout": "eval_holdout",
}
"""Flags that fill a :class:`Recipe` field (the rest of the config fields go to its ``trainer`` table)."""

FILE_ALIASES = {"model": "model_name_or_path", "dataset": "dataset_name", "reward": "reward_funcs"}
"""composer's recipe keys → the TRL flag they mean (both spellings work in a config file)."""

RUN_ONLY = {"config", "no_plot", "threads", "overwrite_output_dir"}
COMPARE_MOVED = (
    "--compare moved out of composer-train: run `nox -s demo -- --compare` (tiny model) or "
    "`python packages/composer-trl/bench/compare_smollm2.py` (SmolLM2) from a checkout."
)


@dataclass
class Invocation:
    """One parsed command line: the recipe plus what only this invocation decides."""

    recipe: Recipe
    resume: str | None
    overwrite: bool
    plot: bool
    threads: int | None


def build_parser() -> Any:
    """HfArgumentParser over the script arguments and ComposerGRPOConfig; errors raise :class:`UsageError`."""
    from transformers import HfArgumentParser

    from composer_trl.args import ComposerModelConfig, ComposerScriptArguments
    from composer_trl.config import ComposerGRPOConfig

    class _Parser(HfArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise UsageError(message)

    types: Any = (ComposerScriptArguments, ComposerModelConfig, ComposerGRPOConfig)
    p = _Parser(types, prog="composer-train", allow_abbrev=False)  # a typo never matches a prefix
    p.description = "Train with composer's objective (GRPO + hinted self-distillation + trace replay) in TRL."
    p.epilog = EXIT_CODES
    return p


EXIT_CODES = (
    "exit codes: 0 finished; 1 unexpected failure (a traceback); 2 bad argument or config (one line; also a prompt "
    "longer than the model's context, a missing extra, an unwritable --output_dir); 3 bad dataset (one line, "
    "nothing written); 4 the --env environment faulted; 5 a reward function raised or scored no completion of a batch (one line; the run's outputs are "
    "removed unless complete checkpoints were saved); 130/143 stopped by SIGINT/SIGTERM (checkpoint written). "
    "See the README's 'Exit codes and what is kept'."
)


def _closest(name: str, valid: Sequence[str]) -> str:
    near = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
    return f"; did you mean {', '.join('--' + n for n in near)}?" if near else "; see composer-train --help."


def _explicit(argv: Sequence[str], parser: Any) -> list[str]:
    """The destinations the command line set (so defaults never override the config file)."""
    out = []
    for tok in argv:
        if tok.startswith("--"):
            action = parser._option_string_actions.get(tok.split("=", 1)[0])
            if action is not None and action.dest != "help":
                out.append(action.dest)
    return out


def parse(argv: Sequence[str]) -> Invocation:
    """Command line (+ ``--config`` file) → :class:`Invocation`; every mistake is one :class:`UsageError`."""
    if any(str(a).split("=", 1)[0] == "--compare" for a in argv):
        raise UsageError(COMPARE_MOVED)
    parser = build_parser()
    valid = sorted(a.dest for a in parser._actions if a.dest != "help")
    ns, rest = parser.parse_known_args(list(argv))
    if rest:
        bad = rest[0].split("=", 1)[0]
        raise UsageError(f"unknown argument {bad}{_closest(bad.lstrip('-').replace('-', '_'), valid)}")
    values: dict[str, Any] = {}
    if ns.config:
        try:
            file_values = read_config_file(ns.config)
        except (ValueError, ImportError) as e:
            raise UsageError(str(e)) from e
        for key, value in file_values.items():
            key = FILE_ALIASES.get(key, key)
            if key not in valid or key == "config":
                raise UsageError(f"--config {ns.config}: unknown field {key!r}{_closest(key, valid)}")
            values[key] = _typed(parser, key, value, ns.config)
    values.update({k: getattr(ns, k) for k in _explicit(argv, parser)})
    return _invocation(values)


def _typed(parser: Any, dest: str, value: Any, source: str) -> Any:
    """A config-file string converted as the flag would convert it (YAML reads ``1e-6`` as a string)."""
    action = next(a for a in parser._actions if a.dest == dest)
    convert = action.type
    if not isinstance(value, str) or convert in (None, str):
        return value
    try:
        return convert(value)
    except (TypeError, ValueError) as e:
        raise UsageError(
            f"--config {source}: `{dest}`={value!r} is not a valid {getattr(convert, '__name__', convert)}."
        ) from e


def _invocation(values: dict[str, Any]) -> Invocation:
    from composer_trl.args import MODEL_CONFIG_FIELDS

    recipe = Recipe()
    run = {k: values.pop(k) for k in list(values) if k in RUN_ONLY}
    resume = values.pop("resume_from_checkpoint", None)
    for key, value in values.items():
        if key in SCRIPT_TO_RECIPE:
            setattr(recipe, SCRIPT_TO_RECIPE[key], value)
        elif key in MODEL_CONFIG_FIELDS:
            recipe.model_args[key] = value
        else:
            recipe.trainer[key] = value
    if isinstance(recipe.reward, str):
        recipe.reward = [recipe.reward]
    if not isinstance(recipe.steps, int) or isinstance(recipe.steps, bool) or recipe.steps < 1:
        raise UsageError(f"--max_steps (or --steps) must be an int >= 1, got {recipe.steps!r}.")
    if not isinstance(recipe.seed, int):
        raise UsageError(f"--seed must be an int, got {recipe.seed!r}.")
    _check_model_args(recipe)
    holdout = recipe.eval_holdout
    if isinstance(holdout, bool) or not isinstance(holdout, int | float) or holdout <= 0:
        raise UsageError(
            f"--eval_holdout must be a fraction in (0, 1) or a number of rows >= 1, got {holdout!r}."
        )
    if "save_steps" in recipe.trainer:
        recipe.trainer.setdefault("save_strategy", "steps")
    _check_env_flags(recipe)
    return Invocation(
        recipe=recipe,
        resume=str(resume) if resume else None,
        overwrite=bool(run.get("overwrite_output_dir", False)),
        plot=not run.get("no_plot", False),
        threads=run.get("threads"),
    )


def _check_model_args(recipe: Recipe) -> None:
    """TRL's own ``ModelConfig`` checks (4 and 8 bit at once, ...) as one line."""
    if recipe.model_args:
        try:
            model_config(recipe)
        except (TypeError, ValueError) as e:
            raise UsageError(str(e).strip().splitlines()[0]) from e


def model_config(recipe: Recipe) -> Any:
    """The run's ``trl.ModelConfig`` (its defaults where the command line set nothing)."""
    from trl import ModelConfig

    return ModelConfig(model_name_or_path=recipe.model, **recipe.model_args)


ENV_EXCLUDES = (("dataset", "--dataset_name"), ("reward", "--reward_funcs"), ("hint_fn", "--hint_fn"))
"""Recipe fields that ``--env`` replaces (the environment gives the prompts, the rewards and the hints)."""


def _check_env_flags(recipe: Recipe) -> None:
    if recipe.env is None:
        return
    if not isinstance(recipe.env, str) or not recipe.env.strip():
        raise UsageError(f"--env must be a string like 'openenv:http://127.0.0.1:8000', got {recipe.env!r}.")
    for attr, flag in ENV_EXCLUDES:
        if getattr(recipe, attr):
            raise UsageError(
                f"--env {recipe.env!r} and {flag} both given: the environment supplies the prompts, rewards "
                f"and hints; drop {flag} or --env."
            )


def quiet_third_party_warnings() -> None:
    """CLI only: hide deprecation warnings of transformers/trl/torch/datasets that users cannot act on."""
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        for module in ("transformers", "trl", "torch", "datasets", "accelerate", "peft"):
            warnings.filterwarnings("ignore", category=category, module=module + r"(\.|$)")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import datasets
    import transformers

    datasets.utils.logging.set_verbosity_error()
    # unreadable files: composer-train reports them in one line
    datasets.utils.logging.get_logger().setLevel(60)
    datasets.disable_progress_bars()  # "Generating train split" bars: composer-train shows its own bar
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def main(argv: Sequence[str] | None = None) -> int:
    from composer_core.envs import EnvError

    quiet_third_party_warnings()
    try:
        inv = parse(sys.argv[1:] if argv is None else argv)
        if inv.plot:
            from composer_trl.plot import _require_matplotlib

            try:
                _require_matplotlib()  # fail before training, not after
            except ImportError as e:
                raise UsageError(f"{e} (or pass --no_plot)") from e
        import torch

        threads = inv.threads if inv.threads is not None else (1 if inv.recipe.model is None else None)
        if threads is not None:  # the tiny model runs ~10x faster on one thread than on contended cores
            torch.set_num_threads(threads)
        cpu_bf16_default(inv.recipe)
        return train_once(inv)
    except EnvError as e:  # raised by the environment's reward/hint functions during training
        print(f"composer-train: error: --env: {e}", file=sys.stderr)
        return EnvFault.exit_code
    except UsageError as e:
        print(f"composer-train: error: {e}", file=sys.stderr)
        return e.exit_code


CPU_NO_BF16 = "composer-train: this CPU has no bf16 support: bf16=False (pass --bf16 true to force)"


def cpu_bf16_default(recipe: Recipe) -> None:
    """Without CUDA, on a CPU with neither AVX512-BF16 nor AMX, turn GRPOConfig's ``bf16=True`` default off (bf16
    autocast would be emulated, several times slower), saying so in one line; a ``bf16`` the user set wins."""
    import torch

    if "bf16" in recipe.trainer or torch.cuda.is_available():
        return
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return
    recipe.trainer["bf16"] = False
    print(CPU_NO_BF16, file=sys.stderr)


def train_once(inv: Invocation) -> int:
    """The single run: check everything, train (resumable, interruptible), save, summarise."""
    recipe = inv.recipe
    out = Path(recipe.output_dir)
    job = Job(recipe, out, name="composer", composer=True)
    preflight.check(
        job
    )  # flags, output dir, model, data, rewards: before the model loads or anything is written
    existed = out.exists()
    overwrite = inv.overwrite or (inv.resume is None and preflight.demo_rerun(recipe, out))
    prepare_output_dir(out, overwrite=overwrite, resume=inv.resume is not None)
    before = set(out.iterdir()) if out.is_dir() else set()
    from composer_core.envs import EnvError

    try:
        result = job.run(resume=inv.resume)
    except (RewardFunctionError, EnvError) as e:
        kept = discard_failed_run(
            out, existed=existed, before=before, trainer_dir=job.trainer_dir, parts=job.checkpoint_parts()
        )
        cause = e.__cause__ if isinstance(e.__cause__, EnvError) else e
        if isinstance(cause, EnvError):  # --env's reward or hint: exit 4, leaving nothing half made
            raise EnvFault(f"--env: {cause}; {kept}") from e
        raise RewardFault(f"{e}; {kept}") from e
    summary: dict[str, Any] = {
        "status": "interrupted" if result["signal"] else "finished",
        "steps": recipe.steps,
        "seed": recipe.seed,
        "model": recipe.model or "tiny-qwen2",
        "composer": result,
    }
    plot_path = None
    if inv.plot and Path(result["metrics"]).is_file():
        from composer_trl.plot import plot_runs
        from composer_trl.progress import read_jsonl

        plot_path = plot_runs({"composer": read_jsonl(result["metrics"])}, out / "metrics.png")
    (out / "summary.json").write_text(dumps(summary, indent=2))
    _report(summary, result, out, plot_path)
    return int(result["exit_code"])


def _report(summary: dict[str, Any], result: dict[str, Any], out: Path, plot_path: Path | None) -> None:
    if result["signal"]:
        print(f"\ncomposer-train stopped by {result['signal']} after step {result['global_step']}")
        print(f"  checkpoint: {result['checkpoint']}  (continue with --resume_from_checkpoint last)")
    else:
        print("\ncomposer-train finished")
        s, e = result["reward_start"], result["reward_end"]
        if s is not None and e is not None:
            print(f"  composer    reward first 10% {s:.3f} -> last 10% {e:.3f}  ({result['seconds']:.0f} s)")
    print(f"  metrics: {Path(result['metrics']).resolve()}")
    if plot_path is not None:
        print(f"  plot:    {plot_path.resolve()}")
    if not result["signal"] and result.get("model"):
        print(f"  model:   {Path(result['model']).resolve()}")
    print(f"  summary: {(out / 'summary.json').resolve()}")


_HUB_ID = preflight.HUB_ID


def load_model(recipe: Recipe) -> tuple[Any, Any]:
    """The tiny model (``model=None``) or ``from_pretrained``; a missing directory is one clear line."""
    if recipe.model is None:
        from composer_core.tasks.digit_reversal import ALPHABET
        from composer_core.tasks.tiny import build_char_tokenizer, build_tiny_model

        tok: Any = build_char_tokenizer(ALPHABET)
        model = build_tiny_model(tok, seed=recipe.seed)
        dtype = recipe.model_args.get("dtype")
        if dtype in ("bfloat16", "float16"):
            import torch

            model = model.to(getattr(torch, dtype))
        return model, tok
    name = recipe.model
    init = model_init_kwargs(recipe)
    local = Path(name).expanduser()
    if name in PACKAGED and not local.is_dir():
        return _load_packaged(name, {k: init[k] for k in ("dtype", "attn_implementation") if k in init})
    if not local.is_dir() and not _HUB_ID.match(name):
        raise UsageError(
            f"--model_name_or_path {name!r}: directory {str(local)!r} does not exist; pass an existing "
            "model directory or a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'."
        )
    try:
        return _pretrained(str(local) if local.is_dir() else name, init, recipe.trust_remote_code)
    except (OSError, ValueError) as e:
        where = "local directory" if local.is_dir() else f"hub id (no directory {str(local)!r} exists)"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--model_name_or_path {name!r} as a {where} could not be loaded: {first}") from e


def _pretrained(name: str, init: dict[str, Any], trust_remote_code: bool = False) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a directory or hub id (left padding; EOS pads when the tokenizer has no pad)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name, padding_side="left", trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=trust_remote_code, **init)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def model_init_kwargs(recipe: Recipe) -> dict[str, Any]:
    """``from_pretrained`` keywords from TRL's ``ModelConfig`` flags, as ``trl grpo`` builds them (``revision``,
    ``attn_implementation``, ``dtype``; ``--load_in_4bit``/``--load_in_8bit``: TRL's ``get_quantization_config``,
    which needs CUDA and bitsandbytes)."""
    from trl import get_quantization_config

    mc = model_config(recipe)
    kwargs: dict[str, Any] = {"revision": mc.model_revision, "dtype": mc.dtype}
    if mc.attn_implementation is not None:
        kwargs["attn_implementation"] = mc.attn_implementation
    quantization = get_quantization_config(mc)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    return kwargs


def model_directory(name: str) -> str:
    """The local directory of ``--model_name_or_path``: a packaged model's converted cache, or the path."""
    if name in PACKAGED and not Path(name).expanduser().is_dir():
        from composer_trl.models import ModelUnavailable, packaged_model_dir

        try:
            return str(packaged_model_dir(name))
        except ModelUnavailable as e:
            raise UsageError(f"--model_name_or_path {name!r}: {e}") from e
    if not Path(name).expanduser().is_dir():
        raise UsageError(f"--model_name_or_path {name!r}: no such directory.")
    return str(Path(name).expanduser())


def _load_packaged(name: str, init: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """A packaged GGUF model (:mod:`composer_trl.models`), converted once; a cache that no longer loads is
    rebuilt once."""
    import shutil

    for attempt in (1, 2):
        folder = Path(model_directory(name))
        try:
            return _pretrained(str(folder), init or {})
        except Exception as e:  # a truncated or edited cache: safetensors, json and OS errors alike
            if attempt == 2:
                raise UsageError(
                    f"--model_name_or_path {name!r}: the converted model in {folder} does not load: {e}"
                ) from e
            shutil.rmtree(folder, ignore_errors=True)
    raise AssertionError("unreachable")


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


def load_env_checked(recipe: Recipe, config: Any, *, need: int, n_rows: int) -> tuple[Any, Any]:
    """``(environment, dataset)`` of ``--env``: rows, rewards and hints come from the environment.

    Bad spec or missing extra: :class:`UsageError` (exit 2); the environment faulting (server down, ...):
    :class:`EnvFault` (exit 4); too few tasks: :class:`DataError` (exit 3); channel 3 on (``beta_replay > 0``)
    but the environment gives no reference answers: :class:`UsageError`.
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
    if (
        getattr(config, "replay_pairs", "columns") == "on_policy"
    ):  # the student's failures are the rejected side
        rows = [{k: v for k, v in r.items() if k != "rejected"} for r in rows]
    elif float(getattr(config, "beta_replay", 0.0)) > 0 and not set(rows[0]) >= PAIR_COLUMNS:
        raise UsageError(
            f"--env {spec!r} gives no reference and wrong answers (channel 3's chosen/rejected); "
            "pass --beta_replay 0 to train without channel 3."
        )
    return env, Dataset.from_list(rows)


def _check_jsonl(path: Path, flag: str) -> None:
    import json

    with path.open() as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError as e:
                    raise DataError(f"{flag} could not be read: line {i} is not JSON ({e}).") from e


class Job:
    """One training run of ``composer-train`` (composer, or plain GRPO for comparisons) in ``out``."""

    def __init__(
        self,
        recipe: Recipe,
        out: Path,
        *,
        name: str,
        composer: bool,
        trainer_overrides: dict[str, Any] | None = None,
        hint_fn: Any = None,
        trainer_cls: Any = None,
        callbacks: Sequence[Any] = (),
        progress: bool = True,
        save_model: bool = True,
    ) -> None:
        self.recipe, self.out, self.name, self.composer = recipe, out, name, composer
        self.overrides = trainer_overrides or {}
        self.hint_fn, self.trainer_cls, self.callbacks = hint_fn, trainer_cls, list(callbacks)
        self.progress, self.save = progress, save_model
        self.trainer_dir = out / f"trainer-{name}"
        self.metrics_path = out / f"metrics-{name}.jsonl"
        self.config = self._config()
        self.dataset: Any = None
        self.eval_dataset: Any = None
        self.channel_line = ""

    def _config(self) -> Any:
        import torch
        from trl import GRPOConfig

        from composer_trl.config import ComposerGRPOConfig

        kwargs = {**self.recipe.trainer_kwargs(), **self.overrides}
        if self.composer:  # channel 2 is on unless set; check() picks its teacher context from the data
            kwargs.setdefault("alpha_sdpo", 1.0)
        else:
            base = {f.name for f in fields(GRPOConfig)}
            kwargs = {k: v for k, v in kwargs.items() if k in base}
        common = run_args(
            self.trainer_dir, self.recipe.steps, self.recipe.seed, not torch.cuda.is_available()
        )
        cls = ComposerGRPOConfig if self.composer else GRPOConfig
        try:
            return cls(**{**common, **kwargs})
        except (TypeError, ValueError) as e:
            raise UsageError(str(e).strip().splitlines()[0]) from e

    def check(self) -> None:
        """Load and check the dataset (and the reward/hint callables) before anything is written."""
        c = self.config
        need = int(c.generation_batch_size) // int(c.num_generations)
        n_rows = max(64, need * (self.recipe.steps + 1))
        if self.recipe.env is not None:
            from composer_core.envs import env_hint_func, env_reward_func

            env, self.dataset = load_env_checked(self.recipe, c, need=need, n_rows=self._with_eval(n_rows))
            check_prompt_lengths(self.recipe, self.config, self.dataset, f"--env {self.recipe.env!r}")
            self._hold_out_eval(need, f"--env {self.recipe.env!r}")
            self.rewards = [env_reward_func(env)]
            if self.composer:  # the environment's feedback is the hint
                self._choose_channels(set(self.dataset.column_names), hints=True)
            self.hint = env_hint_func(env) if self.composer and float(self.config.alpha_sdpo) > 0 else None
            return
        self.dataset = load_dataset_checked(self.recipe, need=need, n_rows=self._with_eval(n_rows))
        flag = f"--dataset_name {self.recipe.dataset!r}" if self.recipe.dataset else "the embedded task"
        check_prompt_lengths(self.recipe, self.config, self.dataset, flag)
        self._hold_out_eval(need, flag)
        try:
            self.rewards = [import_callable(r, "reward_funcs") for r in (self.recipe.reward or [])]
            self.hint = import_callable(self.recipe.hint_fn, "hint_fn") if self.recipe.hint_fn else None
        except ValueError as e:
            raise UsageError(str(e)) from e
        if self.composer:  # a channel without its inputs: one line, exit 2, before the model loads
            from composer_trl.trainer import check_channel_inputs

            embedded = self.recipe.dataset is None
            hints = embedded or self.hint is not None or self.hint_fn is not None
            columns = set(self.dataset.column_names)
            self._choose_channels(columns, hints=hints)
            try:
                check_channel_inputs(self.config, columns, hint_fn=hints)
            except ValueError as e:
                raise UsageError(str(e)) from e

    @property
    def evaluates(self) -> bool:
        strategy = self.config.eval_strategy
        return str(getattr(strategy, "value", strategy)) != "no"

    def _with_eval(self, n_rows: int) -> int:
        """Rows to generate (embedded task, ``--env``) so that ``n_rows`` remain for training after the hold-out."""
        if not self.evaluates:
            return n_rows
        h = self.recipe.eval_holdout
        return n_rows + int(h) if h >= 1 else math.ceil(n_rows / (1 - h))

    def _hold_out_eval(self, need: int, flag: str) -> None:
        """With an ``eval_strategy``: ``--eval_holdout`` rows (a fraction or a count) of the data become the eval set,
        split off with the run's seed; the rest trains."""
        self.eval_dataset = None
        if not self.evaluates:
            return
        h = self.recipe.eval_holdout
        n = len(self.dataset)
        n_eval = int(h) if h >= 1 else math.ceil(n * h)
        if n_eval < 1 or n - n_eval < need:
            raise DataError(
                f"{flag} has {n} rows: holding out {n_eval} for evaluation (--eval_holdout {h}) leaves "
                f"{n - n_eval}, but one optimiser step needs {need} prompts; lower --eval_holdout or add rows."
            )
        split = self.dataset.train_test_split(test_size=n_eval, seed=self.recipe.seed, shuffle=True)
        self.dataset, self.eval_dataset = split["train"], split["test"]

    def _choose_channels(self, columns: set[str], *, hints: bool) -> None:
        """Channel weights the user did not set: from what the data provides (one line says which)."""
        chosen, line = choose_channels({**self.recipe.trainer, **self.overrides}, columns, hints=hints)
        if chosen:
            self.overrides = {**self.overrides, **chosen}
            self.config = self._config()
        self.channel_line = line  # said once the model has loaded (errors before that stay one line)

    def checkpoint_parts(self) -> tuple[str, ...]:
        """Files a complete checkpoint holds besides TRL's own (an ema/base SDPO teacher's weights)."""
        from composer_core.sdpo import TEACHER_STATE_FILE

        c = self.config
        teacher = self.composer and c.alpha_sdpo > 0 and c.teacher_weights_options.sdpo_teacher != "live"
        return (TEACHER_STATE_FILE,) if teacher else ()

    def run(self, *, resume: str | None = None) -> dict[str, Any]:
        """Train (from ``resume``: ``last`` or a checkpoint path); the result row of summary.json."""
        from composer_core.tasks.digit_reversal import reverse_hints, reverse_reward
        from transformers import PrinterCallback, ProgressCallback
        from trl import GRPOTrainer, get_peft_config

        from composer_trl.lifecycle import ComposerState, StopOnSignal
        from composer_trl.progress import MetricsJSONL, ProgressBar
        from composer_trl.trainer import ComposerGRPOTrainer

        if self.dataset is None:
            self.check()
        # an ema/base SDPO teacher's weights are part of a complete checkpoint
        ckpt = resolve_checkpoint(resume, self.trainer_dir, self.checkpoint_parts()) if resume else None
        model, tok = load_model(self.recipe)
        if self.channel_line:
            print(self.channel_line, file=sys.stderr)
        extra: dict[str, Any] = {}
        if self.composer:
            embedded = self.recipe.dataset is None and self.recipe.env is None
            wants = (
                self.config.alpha_sdpo > 0
                and self.config.teacher_context_options.sdpo_teacher_context != "success"
            )
            auto = reverse_hints if embedded and wants else None
            hint = self.hint_fn or (self.hint if wants else None) or auto
            if hint is not None:
                extra["hint_fn"] = hint
        cls = self.trainer_cls or (ComposerGRPOTrainer if self.composer else GRPOTrainer)
        rewards: list[Any] = list(self.rewards) or [reverse_reward]
        try:
            peft_config = get_peft_config(model_config(self.recipe))  # TRL's own LoRA config (--use_peft ...)
        except ValueError as e:
            raise UsageError(str(e).strip().splitlines()[0]) from e
        if peft_config is not None:
            extra["peft_config"] = peft_config
        trainer = cls(
            model=model,
            reward_funcs=rewards,
            args=self.config,
            train_dataset=self.dataset,
            eval_dataset=self.eval_dataset,
            processing_class=tok,
            **extra,
        )
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        stop = StopOnSignal()
        resume_step = checkpoint_step(ckpt) if ckpt is not None else None
        cbs = [ComposerState(trainer, ckpt), stop, MetricsJSONL(self.metrics_path, resume_step=resume_step)]
        if self.progress:
            cbs.append(ProgressBar(self.name))
        for cb in [*cbs, *self.callbacks]:
            trainer.add_callback(cb)
        start = time.perf_counter()
        stop.install()
        try:
            trainer.train(resume_from_checkpoint=str(ckpt) if ckpt else None)
        finally:
            stop.uninstall()
            _erase_progress(cbs)  # a run that raised: its error line is not glued to the bar
        seconds = time.perf_counter() - start
        return self._result(trainer, tok, stop, seconds)

    def _result(self, trainer: Any, tok: Any, stop: Any, seconds: float) -> dict[str, Any]:
        from composer_trl.progress import read_jsonl

        step = int(trainer.state.global_step)
        result: dict[str, Any] = {"seconds": seconds, "metrics": str(self.metrics_path), "global_step": step}
        result.update(signal=stop.received, exit_code=stop.code, checkpoint=None, model=None)
        if stop.received:
            result["checkpoint"] = str(self.trainer_dir / f"checkpoint-{step}")
        elif self.save:
            trainer.save_model(str(self.out / "model"))
            tok.save_pretrained(str(self.out / "model"))
            write_model_card(trainer, self.out / "model", self.recipe, composer=self.composer)
            result["model"] = str(self.out / "model")
        rewards = [r["reward"] for r in read_jsonl(self.metrics_path) if r.get("reward") is not None]
        k = max(1, len(rewards) // 10)
        result["reward_start"] = sum(rewards[:k]) / k if rewards else None
        result["reward_end"] = sum(rewards[-k:]) / k if rewards else None
        self.trainer = trainer
        return result


def run_args(output_dir: str | Path, steps: int, seed: int, use_cpu: bool) -> dict[str, Any]:
    """The config keywords every run of composer-train sets (no report_to, no checkpoints unless asked)."""
    return {
        "output_dir": str(output_dir),
        "max_steps": steps,
        "seed": seed,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": use_cpu,
    }


CARD_OPTIONS = (
    "alpha_sdpo",
    "beta_replay",
    "sdpo_form",
    "sdpo_teacher_context",
    "sdpo_teacher",
    "sdpo_wrapper",
    "dpo_variant",
    "replay_reference",
    "loss_type",
    "beta",
    "learning_rate",
    "num_generations",
    "max_completion_length",
)
"""Config fields the model card's table names (composer's channels, then the GRPO settings they sit on)."""


def write_model_card(trainer: Any, folder: Path, recipe: Recipe, *, composer: bool) -> Path:
    """``folder/README.md``: TRL's model card (``create_model_card``: YAML metadata, usage, framework versions,
    citation) tagged ``composer``, plus a section naming the objective and the options it was trained with."""
    args = trainer.args
    kept = args.output_dir
    tags = ["composer", "sdpo", "trace-replay"] if composer else []
    args.output_dir = str(folder)  # TRL writes the card to output_dir/README.md
    try:
        trainer.create_model_card(model_name=folder.parent.name, dataset_name=recipe.dataset, tags=tags)
    finally:
        args.output_dir = kept
    path = folder / "README.md"
    if not path.is_file():  # not the main process
        return path
    if composer:
        objective = (
            "composer's 3-channel objective: GRPO (channel 1) + hinted self-distillation, SDPO "
            "(channel 2, weight `alpha_sdpo`) + trace replay (channel 3, weight `beta_replay`)"
        )
    else:
        objective = "GRPO alone (composer-train's comparison baseline)"
    rows = [f"| {name} | {getattr(args, name)} |" for name in CARD_OPTIONS if hasattr(args, name)]
    lines = ["", "## composer", "", f"Trained with `composer-train` on {objective}.", ""]
    lines += [f"- model: `{recipe.model or 'tiny-qwen2 (built from config)'}`"]
    lines += [f"- data: `{recipe.env or recipe.dataset or 'the embedded digit-reversal task'}`"]
    lines += [f"- steps: {trainer.state.global_step}, seed: {recipe.seed}"]
    if recipe.model_args.get("use_peft"):
        lora = {k: v for k, v in recipe.model_args.items() if k.startswith("lora_")}
        lines += [f"- LoRA (TRL's `get_peft_config`): {lora}"]
    lines += ["", "| option | value |", "| --- | --- |", *rows, ""]
    with path.open("a") as f:
        f.write("\n".join(lines))
    return path


def _erase_progress(callbacks: Sequence[Any]) -> None:
    """Close a progress bar left open by a run that raised (a finished run closed it), erasing it."""
    for cb in callbacks:
        bar = getattr(cb, "bar", None)
        if bar is not None:
            bar.leave = False
            bar.close()
            cb.bar = None


def check_prompt_lengths(recipe: Recipe, config: Any, dataset: Any, flag: str) -> None:
    """Refuse (:class:`UsageError`, exit 2) the first prompt whose tokens + ``max_completion_length`` exceed the
    model's context, before the model loads: TRL 1.16 has no prompt truncation and would generate over it
    (minutes or an out-of-memory error for a 100,000-token prompt). Tokenized as ``GRPOTrainer`` tokenizes."""
    from composer_trl.guards import overlong_prompt, prompt_lengths, prompt_too_long_message

    found = _tokenizer_and_context(recipe, config)
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


def _tokenizer_and_context(recipe: Recipe, config: Any) -> tuple[Any, int] | None:
    """The tokenizer and context length of ``recipe.model`` without loading its weights (None: they cannot be
    read here; :func:`load_model` then reports the problem in its own line)."""
    from composer_trl.guards import context_length

    if recipe.model is None:
        from composer_core.tasks.digit_reversal import ALPHABET
        from composer_core.tasks.tiny import TinyModelConfig, build_char_tokenizer

        return build_char_tokenizer(ALPHABET), TinyModelConfig().max_position_embeddings
    from transformers import AutoConfig, AutoTokenizer

    try:
        local = Path(recipe.model).expanduser()
        name = (
            model_directory(recipe.model) if recipe.model in PACKAGED and not local.is_dir() else recipe.model
        )
        name = str(local) if local.is_dir() else name
        remote = recipe.trust_remote_code
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=remote)
        context = context_length(AutoConfig.from_pretrained(name, trust_remote_code=remote))
    except Exception:  # load_model says what is wrong with the model, in one line
        return None
    vllm_len = getattr(config, "vllm_max_model_length", None)
    if getattr(config, "use_vllm", False) and getattr(config, "vllm_mode", None) == "colocate" and vllm_len:
        context = int(vllm_len)
    return (tok, context) if context is not None else None


def _entry() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())


if __name__ == "__main__":
    _entry()
