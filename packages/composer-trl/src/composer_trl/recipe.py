"""Training recipes for ``composer-train``: defaults for the embedded task, overridable by TOML/YAML.

A recipe file has optional top-level keys and one ``[trainer]`` table of
:class:`~composer_trl.ComposerGRPOConfig` fields::

    model = "Qwen/Qwen2.5-0.5B-Instruct"     # local directory or hub id (default: tiny Qwen2 from config)
    dataset = "data/train.jsonl"              # json/jsonl/parquet/csv with `prompt` (+ hint/chosen/rejected)
    reward = "my_pkg.rewards.passes_tests"    # "module.function", "module:function" or a TRL reward name
    hint_fn = "my_pkg.rewards:test_feedback"  # "module.function"/"module:function" or omit (a `hint` column)
    env = "openenv:http://127.0.0.1:8000"     # or: prompts, rewards and hints from an environment
    steps = 300
    seed = 0
    output_dir = "runs/my-run"

    [trainer]
    learning_rate = 1e-6
    alpha_sdpo = 0.5
    dpo_variant = "dpo"

An unknown key is refused in one line naming it (a typo never silently falls back to a default).
"""

from __future__ import annotations

import importlib
import os
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_core.loss.config import ComposeConfig

TINY_TRAINER_DEFAULTS: dict[str, Any] = {
    # Measured on 2 shared CPU cores, 1 thread: 300 steps ≈ 1–1.5 min; composer's reward 0.06 → ≈0.69
    # (seeds 0 and 2; see the package README for GRPO alone).
    "learning_rate": 2e-3,
    "per_device_train_batch_size": 32,
    "num_generations": 4,
    "max_completion_length": 3,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "logging_steps": 1,
    "dpo_variant": "simpo",
}
"""Trainer settings of the no-argument run (the tiny model on digit reversal; its hints and pairs switch both
channels on through :func:`choose_channels`)."""

COMPOSER_PRESET: dict[str, float] = {"alpha_sdpo": 1.0, "beta_replay": 1.0}
"""The ``composer`` recipe's preset channel weights, where the recipe sets none and the data feeds the channel
(:func:`choose_channels`); composer_core's defaults are 0 (channels off), which a channel without data keeps."""

HINT_COLUMNS = frozenset({"hint", "hinted_prompt", "teacher_prompt"})
PAIR_COLUMNS = frozenset({"chosen", "rejected"})

MODEL_TRAINER_DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-6,
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    "max_completion_length": 8,
    "logging_steps": 1,
    "dpo_variant": "simpo",
}
"""Trainer settings when ``--model`` names a real model (override them in the recipe)."""


@dataclass
class Recipe:
    """Everything ``composer-train`` needs; ``trainer`` holds ``ComposerGRPOConfig`` keyword arguments."""

    model: str | None = None
    dataset: str | None = None
    reward: str | list[str] | None = None
    hint_fn: str | None = None
    env: str | None = None
    steps: int = 300
    seed: int = 0
    output_dir: str = "runs/composer-train"
    trust_remote_code: bool = False
    eval_holdout: float = 0.1
    """With an ``eval_strategy``: the rows held out as the eval set (a fraction < 1 or a number of rows)."""
    trainer: dict[str, Any] = field(default_factory=dict)
    model_args: dict[str, Any] = field(default_factory=dict)
    """TRL ``ModelConfig`` fields set (``use_peft``, ``lora_r``, ``dtype``, ...; see :mod:`composer_trl.args`)."""

    def trainer_kwargs(self) -> dict[str, Any]:
        """Defaults for the chosen model kind, overridden by the recipe's ``[trainer]`` table."""
        base = MODEL_TRAINER_DEFAULTS if self.model else TINY_TRAINER_DEFAULTS
        return {**base, **self.trainer}


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A ``.toml``/``.yaml``/``.yml`` file as one flat mapping (a ``trainer`` table is merged in).

    Takes both composer's recipe layout (top-level keys + ``[trainer]``) and the flat YAML that
    ``trl grpo --config`` takes (every key a flag name). Errors raise ``ValueError`` naming the file.
    """
    data = _read_mapping(path)
    trainer = data.pop("trainer", {})
    if not isinstance(trainer, dict):
        raise ValueError(f"{path}: `trainer` must be a table of ComposerGRPOConfig fields.")
    env = data.pop("env", None)
    if isinstance(env, str):  # composer's `env = "openenv:<url>"`: the --env flag (an environment spec)
        data["env"] = env
    elif env is not None:  # TrlParser's `env:` block: environment variables, set as TRL sets them
        if not isinstance(env, dict):
            raise ValueError(f"{path}: `env` must be a mapping of environment variables.")
        os.environ.update({str(k): str(v) for k, v in env.items()})
    clash = set(data) & set(trainer)
    if clash:
        raise ValueError(f"{path}: {sorted(clash)} set both at top level and in [trainer]; keep one.")
    return {**data, **trainer}


def _read_mapping(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {str(p)!r} is not a file; pass a .toml or .yaml recipe.")
    suffix = p.suffix.lower()
    if suffix == ".toml":
        with p.open("rb") as f:
            data = tomllib.load(f)
    elif suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as e:
            raise ImportError("YAML recipes need PyYAML: pip install 'composer-trl[yaml]'") from e
        data = yaml.safe_load(p.read_text()) or {}
    else:
        raise ValueError(f"--config {str(p)!r}: unknown recipe format {suffix!r}; use .toml, .yaml or .yml.")
    if not isinstance(data, dict):
        raise ValueError(f"recipe {str(p)!r} must be a mapping of keys, got {type(data).__name__}.")
    return data


def trl_reward_functions() -> dict[str, Callable[..., Any]]:
    """The reward names ``trl grpo --reward_funcs`` takes (TRL 1.16 ``trl/scripts/grpo.py``'s registry, with its
    arguments)."""
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    return {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(
            max_completion_len=1280, soft_punish_cache=256
        ),
    }


def import_callable(spec: str, what: str) -> Callable[..., Any]:
    """Resolve a callable as ``trl grpo`` does: ``module.function`` or ``module:function``, imported with the working
    directory on ``sys.path``; for ``reward_funcs`` also TRL's built-in reward names (:func:`trl_reward_functions`)."""
    builtin = trl_reward_functions() if what == "reward_funcs" else {}
    if spec in builtin:
        return builtin[spec]
    module_name, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    forms = "'module.function' or 'module:function'" + (
        f" or one of TRL's {sorted(builtin)}" if builtin else ""
    )
    if not sep or not module_name or not attr:
        raise ValueError(f"`{what}`={spec!r} must be {forms}.")
    if os.getcwd() not in sys.path:  # `trl grpo` imports reward modules from the working directory
        sys.path.insert(0, os.getcwd())
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"`{what}`={spec!r} cannot be imported ({e}); it must be {forms}.") from e
    if not callable(obj):
        raise ValueError(f"`{what}`={spec!r} is not callable.")
    return obj  # type: ignore[no-any-return]


def choose_channels(trainer: dict[str, Any], columns: set[str], *, hints: bool) -> tuple[dict[str, Any], str]:
    """The channel weights ``composer-train`` uses where the recipe sets none, from what the data provides, and the
    one line that says so.

    Channel 2 is on: taught by hints where the data has them (a hint column, ``--hint_fn``, an environment's
    hints, the embedded task), else by a successful sibling of each group (``sdpo_teacher_context='success'``:
    rewards are all it needs). Channel 3 is on where the dataset has ``chosen`` and ``rejected`` columns.
    """
    chosen: dict[str, Any] = {}
    said: list[str] = []
    if "alpha_sdpo" not in trainer:
        chosen["alpha_sdpo"] = COMPOSER_PRESET["alpha_sdpo"]
        if "sdpo_teacher_context" in trainer:
            why = f"teacher context {trainer['sdpo_teacher_context']!r} as set"
        elif hints or columns & HINT_COLUMNS:
            why = "the data's hints teach"
        else:
            chosen["sdpo_teacher_context"] = "success"
            why = "no hints: a successful sibling of each group teaches"
        said.append(f"alpha_sdpo={chosen['alpha_sdpo']} ({why})")
    if "beta_replay" not in trainer:
        on_policy = trainer.get("replay_pairs") == "on_policy" and "chosen" in columns
        pairs = columns >= PAIR_COLUMNS or on_policy
        chosen["beta_replay"] = COMPOSER_PRESET["beta_replay"] if pairs else ComposeConfig.beta_replay
        said.append(
            f"beta_replay={chosen['beta_replay']} ({'chosen/rejected columns' if pairs else 'no chosen/rejected columns'})"
        )
    if not said:
        return chosen, ""
    return chosen, "composer-train: " + ", ".join(said) + "; set --alpha_sdpo / --beta_replay to choose."
