"""What ``composer-train`` checks before the model loads (issue 62), each refusal one line, exit 2: a flag's optional
dependency, a writable ``--output_dir``, a reachable Hub model, each ``--reward_funcs``' inputs, and the demo rerun
into its own directory (the package README's exit code 2).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from composer_trl.lifecycle import UsageError
from composer_trl.models import HUB_ID, PACKAGED
from composer_trl.recipe import Recipe

EMBEDDED_TASK = (
    "composer-train: no --dataset_name: training on the embedded digit-reversal task (pass --dataset_name "
    "data.jsonl or --env to train on yours)"
)

REPORT_EXTRAS = ("tensorboard", "wandb")
"""``--report_to`` integrations with a composer-trl extra of the same name."""

TRL_PASSED = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)
"""What TRL 1.16's ``GRPOTrainer`` passes every reward function besides the dataset's columns."""

TRL_CHAT_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")
"""TRL's built-in rewards that read ``completion[0]["content"]``: they need conversational prompts (the first two
also math-verify)."""


def check(job: Any) -> None:
    """Every check of this module, then the job's own (:meth:`composer_trl.job.Job.check`: data, channels,
    config)."""
    recipe = job.recipe
    check_extras(job.args, recipe)
    check_output_dir(job.out)
    check_hub_model(recipe)
    job.check()
    if recipe.env is None and recipe.reward:
        check_reward_inputs(recipe.reward, job.rewards, job.dataset)
    if recipe.model is not None and recipe.dataset is None and recipe.env is None:  # said once it loaded
        job.channel_line = "\n".join(filter(None, [EMBEDDED_TASK, job.channel_line]))


def check_extras(config: Any, recipe: Recipe) -> None:
    """``--report_to X`` and ``--use_peft`` with their packages installed."""
    from transformers.integrations import integration_utils

    report = config.report_to or []
    for name in [report] if isinstance(report, str) else report:
        available = getattr(integration_utils, f"is_{name}_available", None)
        if name in ("none", "all") or available is None or available():
            continue
        fix = f"pip install 'composer-trl[{name}]'" if name in REPORT_EXTRAS else f"install {name}"
        raise UsageError(
            f"--report_to {name} needs {name}, which is not installed: {fix} (or drop the flag)."
        )
    if recipe.model_args.get("use_peft") and importlib.util.find_spec("peft") is None:
        raise UsageError("--use_peft needs peft, which is not installed: pip install 'composer-trl[peft]'.")


def check_output_dir(out: Path) -> None:
    """``out`` exists as a writable directory or can be created (its nearest existing parent is one)."""
    if out.exists() and not out.is_dir():
        return  # prepare_output_dir says "is a file"
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        why = "a file" if not parent.is_dir() else "not writable by you"
        raise UsageError(
            f"--output_dir {str(out)!r} is not writable ({str(parent)!r} is {why}); pass a directory you can write."
        )


def check_hub_model(recipe: Recipe) -> None:
    """A Hub id that is neither cached nor answered by the Hub: one line (one request, no retries: transformers
    would retry each file for about two minutes before its own error)."""
    name = recipe.model
    if name is None or name in PACKAGED or Path(name).expanduser().is_dir() or not HUB_ID.match(name):
        return  # the tiny model, a packaged one, a directory, or a missing one (load_model says so)
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError

    revision = recipe.model_args.get("model_revision") or "main"
    if isinstance(try_to_load_from_cache(name, "config.json", revision=revision), str):
        return
    where = f"--model_name_or_path {name!r} is not a local directory nor in the Hugging Face cache"
    if constants.HF_HUB_OFFLINE:
        raise UsageError(
            f"{where}, and HF_HUB_OFFLINE is set; download it once online or pass a model directory."
        )
    try:
        model_info(name, revision=revision, timeout=10)
    except RepositoryNotFoundError as e:
        raise UsageError(f"{where}, and the Hub has no such model (or it is private: log in).") from e
    except Exception as e:  # no network, a proxy refusing, a timeout: all mean "cannot be reached"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"{where}, and the Hub cannot be reached ({type(e).__name__}: {first}); connect, or pass a local model "
            "directory (smollm2-135m-instruct needs no download)."
        ) from e


def required_arguments(func: Any) -> list[str]:
    """The arguments of a reward function that have no default and that TRL fills only from dataset columns."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is p.empty and p.name not in TRL_PASSED]


def check_reward_inputs(specs: Sequence[str], funcs: Sequence[Any], dataset: Any) -> None:
    """Each ``--reward_funcs`` gets its required columns, and TRL's chat rewards conversational prompts."""
    import trl.rewards
    from trl.data_utils import is_conversational

    columns = list(dataset.column_names)
    chat = {id(getattr(trl.rewards, n)) for n in TRL_CHAT_REWARDS if hasattr(trl.rewards, n)}
    math = {id(getattr(trl.rewards, n)) for n in TRL_CHAT_REWARDS[:2] if hasattr(trl.rewards, n)}
    for spec, func in zip(specs, funcs, strict=True):
        for arg in required_arguments(func):
            if arg not in columns:
                raise UsageError(
                    f"--reward_funcs {spec} needs a `{arg}` column (its argument {arg!r}); the dataset has "
                    f"{columns}: add the column or choose another reward function."
                )
        if id(func) in chat and len(dataset) and not is_conversational(dataset[0]):
            raise UsageError(
                f"--reward_funcs {spec} needs conversational prompts (a `prompt` column of "
                "[{'role': 'user', 'content': ...}] messages; it reads completion[0]['content']), but the prompts "
                "are plain text: convert them or choose another reward function."
            )
        if id(func) in math and importlib.util.find_spec("math_verify") is None:
            raise UsageError(
                f"--reward_funcs {spec} needs math-verify (TRL parses LaTeX answers with it), which is not "
                "installed: pip install 'composer-trl[math]'."
            )


def demo_rerun(recipe: Recipe, out: Path) -> bool:
    """True (said in one line) when this is the demo (tiny model, embedded task, default ``--output_dir``) and
    ``out`` holds a previous demo run (its ``summary.json`` names the tiny model): the demo reruns as is."""
    demo = recipe.model is None and recipe.dataset is None and recipe.env is None
    if not demo or recipe.output_dir != Recipe.output_dir:
        return False
    try:
        previous = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(previous, dict) or previous.get("model") != "tiny-qwen2":
        return False
    print(
        f"composer-train: replacing the previous demo run in {out} (pass --output_dir to keep both)",
        file=sys.stderr,
    )
    return True
