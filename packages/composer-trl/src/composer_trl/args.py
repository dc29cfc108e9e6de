"""``composer-train``'s script arguments: the fields TRL's ``ScriptArguments``/``ModelConfig`` would hold.

Parsed by TRL's ``TrlParser`` (which reserves ``--config`` for the config file) together with :class:`~composer_trl.ComposerGRPOConfig` (so
every config field is a flag: ``--alpha_sdpo 0.5 --learning_rate 1e-6``) and :class:`ComposerModelConfig`
(TRL's ``ModelConfig``: ``--use_peft --lora_r 8``). This module has no
``from __future__ import annotations``: HfArgumentParser reads the field types at runtime.
"""

from dataclasses import dataclass, field, fields

from trl import ModelConfig

from composer_trl.recipe import Recipe


@dataclass
class ComposerModelConfig(ModelConfig):
    """TRL's ``ModelConfig`` (``--use_peft --lora_r 8 --lora_target_modules q_proj v_proj``, ``--dtype``,
    ``--attn_implementation``, ``--model_revision``, ``--load_in_4bit``, ...) with composer's ``--model`` alias and
    default (no model: the tiny Qwen2)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "local model directory or hub id (default: a tiny Qwen2 built from config, no download)",
            "aliases": ["--model"],
        },
    )


MODEL_CONFIG_FIELDS = frozenset(f.name for f in fields(ModelConfig)) - {"model_name_or_path"}
"""The ``ModelConfig`` flags besides the model itself: they go to the model loading and ``get_peft_config``."""


@dataclass
class ComposerScriptArguments:
    """Arguments of the main job that are neither trainer config nor ``ModelConfig`` fields."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "local .json/.jsonl/.parquet/.csv with a `prompt` column (+ hint/chosen/rejected); "
            "default: the embedded digit-reversal task",
            "aliases": ["--dataset"],
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "one or more 'package.module:function' rewards (default: the task's verifier)"},
    )
    hint_fn: str | None = field(default=None, metadata={"help": "'package.module:function' building hints"})
    env: str | None = field(
        default=None,
        metadata={
            "help": "environment giving the prompts, rewards and hints (and reference answers as channel 3's "
            "`chosen`): 'digit-reversal', 'openenv:<url>' (composer-core[openenv]) or 'verifiers:<module>' "
            "(composer-core[verifiers]); excludes --dataset_name, --reward_funcs and --hint_fn"
        },
    )
    eval_holdout: float = field(
        default=0.1,
        metadata={
            "help": "with --eval_strategy steps/epoch: the rows held out of the training set as the eval set "
            "(a fraction < 1, or a number of rows >= 1), for the embedded task, --dataset_name and --env alike"
        },
    )
    steps: int | None = field(
        default=None, metadata={"help": f"alias of --max_steps (default {Recipe.steps})"}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "replace composer-train's outputs in a non-empty --output_dir"}
    )
    no_plot: bool = field(default=False, metadata={"help": "skip the PNG (no matplotlib needed)"})
    threads: int | None = field(
        default=None, metadata={"help": "torch CPU threads (default: 1 for the tiny model, else torch's)"}
    )
