"""``composer-train``: train with composer's 3-channel objective inside TRL, in one command.

With no arguments: a tiny Qwen2 (random init, no download) on the embedded digit-reversal task (reward from the
verifier, hints from its feedback, oracle answers as channel 3's traces); ``--dataset_name``/``--reward_funcs``/
``--hint_fn`` or ``--env`` (:mod:`composer_core.envs`) train on yours. Arguments follow TRL's conventions: TRL's
``TrlParser`` over :mod:`composer_trl.args` and :class:`~composer_trl.ComposerGRPOConfig` (every config field is a
flag), ``--config`` a YAML/TOML file whose values the flags override. This module parses and reports; the run is
:class:`composer_trl.job.Job`. Exit codes: see :mod:`composer_trl.lifecycle`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NoReturn

from composer_trl import preflight
from composer_trl.guards import RewardFunctionError
from composer_trl.job import Job
from composer_trl.lifecycle import (
    EnvFault,
    RewardFault,
    UsageError,
    discard_failed_run,
    dumps,
    prepare_output_dir,
)
from composer_trl.models import model_config
from composer_trl.recipe import Recipe, read_config_file

RECIPE_FLAGS = {
    "model_name_or_path": "model",
    "dataset_name": "dataset",
    "reward_funcs": "reward",
    "max_steps": "steps",
}
"""Flags that fill a :class:`Recipe` field of another name (the rest of the config fields go to its ``trainer``
table); the first three are also the recipe keys of a config file."""
RECIPE_FIELDS = {f.name for f in fields(Recipe)} - {"trainer", "model_args"}

RUN_ONLY = {"no_plot", "threads", "overwrite_output_dir"}
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
    """TRL's ``TrlParser`` over the script arguments, ``ModelConfig`` and ComposerGRPOConfig, plus ``--config``;
    errors raise :class:`UsageError`."""
    from trl import TrlParser

    from composer_trl.args import ComposerModelConfig, ComposerScriptArguments
    from composer_trl.config import ComposerGRPOConfig

    class _Parser(TrlParser):
        def error(self, message: str) -> NoReturn:
            raise UsageError(message)

    types: Any = (ComposerScriptArguments, ComposerModelConfig, ComposerGRPOConfig)
    p = _Parser(types, prog="composer-train", allow_abbrev=False)  # a typo never matches a prefix
    p.add_argument(
        "--config", help="YAML (as `trl grpo --config` takes it) or TOML recipe; flags win over it"
    )
    p.description = "Train with composer's objective (GRPO + hinted self-distillation + trace replay) in TRL."
    p.epilog = EXIT_CODES
    return p


EXIT_CODES = (
    "exit codes: 0 finished; 1 unexpected failure (a traceback); 2 bad argument or config (one line; also a prompt "
    "longer than the model's context, a missing extra, an unwritable --output_dir); 3 bad dataset (one line, "
    "nothing written); 4 the --env environment faulted; 5 a reward function raised or scored no completion of a "
    "batch (one line; the run's outputs are removed unless complete checkpoints were saved); 130/143 stopped by "
    "SIGINT/SIGTERM (checkpoint written). See the README's 'Exit codes and what is kept'."
)


def _closest(name: str, valid: Sequence[str]) -> str:
    near = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
    return f"; did you mean {', '.join('--' + n for n in near)}?" if near else "; see composer-train --help."


def parse(argv: Sequence[str]) -> Invocation:
    """Command line (+ ``--config`` file) → :class:`Invocation`; every mistake is one :class:`UsageError`.

    The file's values become the parser's defaults (TRL's ``TrlParser.set_defaults_with_config``), so a flag wins
    over the file and a string from the file is converted as the flag's string would be; what neither sets is left
    out (the recipe's defaults apply)."""
    if any(str(a).split("=", 1)[0] == "--compare" for a in argv):
        raise UsageError(COMPARE_MOVED)
    parser = build_parser()
    valid = sorted(a.dest for a in parser._actions if a.dest not in ("help", "config"))
    ns, rest = parser.parse_known_args(list(argv))
    if rest:
        bad = rest[0].split("=", 1)[0]
        raise UsageError(f"unknown argument {bad}{_closest(bad.lstrip('-').replace('-', '_'), valid)}")
    given: dict[str, Any] = {}
    if ns.config:
        try:
            aliases = {v: k for k, v in RECIPE_FLAGS.items() if v != "steps"}
            given = {aliases.get(k, k): v for k, v in read_config_file(ns.config).items()}
        except (ValueError, ImportError) as e:
            raise UsageError(str(e)) from e
        unknown = [f"--{k}" for k in given if k == "config"] + parser.set_defaults_with_config(**given)
        if unknown:
            key = unknown[0][2:]
            raise UsageError(f"--config {ns.config}: unknown field {key!r}{_closest(key, valid)}")
    for action in parser._actions:
        if action.dest not in given:
            action.default = argparse.SUPPRESS
    try:
        values = vars(parser.parse_args(list(argv)))
    except UsageError as e:  # the command line parsed above: only the file's values are new here
        raise UsageError(f"--config {ns.config}: {e}") from e
    values.pop("config", None)
    return _invocation(values)


def _invocation(values: dict[str, Any]) -> Invocation:
    from composer_trl.args import MODEL_CONFIG_FIELDS

    recipe = Recipe()
    run = {k: values.pop(k) for k in list(values) if k in RUN_ONLY}
    resume = values.pop("resume_from_checkpoint", None)
    for key, value in values.items():
        if RECIPE_FLAGS.get(key, key) in RECIPE_FIELDS:
            setattr(recipe, RECIPE_FLAGS.get(key, key), value)
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
    try:  # TRL's own ModelConfig checks (4 and 8 bit at once, ...) as one line
        model_config(recipe)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e).strip().splitlines()[0]) from e
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
            from composer_trl.plot import require_matplotlib

            try:
                require_matplotlib()  # fail before training, not after
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
    job = Job(recipe, out)
    # flags, output dir, model, data, rewards, the config: before the model loads or anything is written
    preflight.check(job)
    existed = out.exists()
    overwrite = inv.overwrite or (inv.resume is None and preflight.demo_rerun(recipe, out))
    prepare_output_dir(out, overwrite=overwrite, resume=inv.resume is not None)
    before = set(out.iterdir()) if out.is_dir() else set()
    from composer_core.envs import EnvError

    try:
        result = job.run(resume=inv.resume)
    except (RewardFunctionError, EnvError, UsageError) as e:
        kept = discard_failed_run(
            out, existed=existed, before=before, trainer_dir=job.trainer_dir, parts=job.checkpoint_parts()
        )
        if isinstance(e, UsageError):  # the trainer refused its inputs (one line): nothing left half made
            raise
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


def _entry() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())


if __name__ == "__main__":
    _entry()
