"""The model card ``composer-train`` writes beside the trained model: TRL's own, plus the objective and options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer_trl.recipe import Recipe

CARD_OPTIONS = (
    "w_policy",
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
OBJECTIVE = (
    "composer's 3-channel objective: GRPO (channel 1) + hinted self-distillation, SDPO (channel 2, weight "
    "`alpha_sdpo`) + trace replay (channel 3, weight `beta_replay`)"
)


def write_model_card(trainer: Any, folder: Path, recipe: Recipe) -> Path:
    """``folder/README.md``: TRL's model card (``create_model_card``: YAML metadata, usage, framework versions,
    citation) tagged ``composer``, plus a section naming the objective and the options it was trained with."""
    args = trainer.args
    kept = args.output_dir
    args.output_dir = str(folder)  # TRL writes the card to output_dir/README.md
    try:
        tags = ["composer", "sdpo", "trace-replay"]
        trainer.create_model_card(model_name=folder.parent.name, dataset_name=recipe.dataset, tags=tags)
    finally:
        args.output_dir = kept
    path = folder / "README.md"
    if not path.is_file():  # not the main process
        return path
    rows = [f"| {name} | {getattr(args, name)} |" for name in CARD_OPTIONS if hasattr(args, name)]
    lines = ["", "## composer", "", f"Trained with `composer-train` on {OBJECTIVE}.", ""]
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
