"""One training run of ``composer-train``: its data and channels checked before the model loads, its config built
once, the trainer with composer's callbacks (checkpoint state, signals, metrics, progress bar), the saved model."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

from composer_trl.card import write_model_card
from composer_trl.data import check_prompt_lengths, load_dataset_checked, load_env_checked
from composer_trl.lifecycle import (
    ComposerState,
    DataError,
    StopOnSignal,
    UsageError,
    checkpoint_step,
    resolve_checkpoint,
)
from composer_trl.models import load_model, model_config
from composer_trl.progress import MetricsJSONL, ProgressBar, read_jsonl
from composer_trl.recipe import Recipe, choose_channels, import_callable


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


def build(cls: Any, kwargs: dict[str, Any]) -> Any:
    """``cls(**kwargs)`` (a TRL or composer config); its refusal is one :class:`UsageError` line."""
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e).strip().splitlines()[0]) from e


class Job:
    """One training run of ``composer-train`` in ``out``: :meth:`check` (data, rewards, channels, the config),
    :meth:`run` (train, save, the result row of ``summary.json``)."""

    name = "composer"

    def __init__(self, recipe: Recipe, out: Path) -> None:
        import torch
        from trl import GRPOConfig

        self.recipe, self.out = recipe, out
        self.trainer_dir = out / f"trainer-{self.name}"
        self.metrics_path = out / f"metrics-{self.name}.jsonl"
        self.run_args = run_args(self.trainer_dir, recipe.steps, recipe.seed, not torch.cuda.is_available())
        grpo = GRPOConfig.__dataclass_fields__
        trl_only = {k: v for k, v in recipe.trainer_kwargs().items() if k in grpo}
        # TRL's options alone (batch sizes, evaluation, report_to): what the checks before the config read
        self.args = build(GRPOConfig, {**self.run_args, **trl_only})
        self.config: Any = None
        self.dataset: Any = None
        self.eval_dataset: Any = None
        self.rewards: list[Any] = []
        self.hint: Any = None
        self.channel_line = ""

    def check(self) -> None:
        """Load and check the data (and the reward/hint callables) before anything is written, choose the channel
        weights the user did not set from what the data provides, and build the run's config (once)."""
        need = int(self.args.generation_batch_size) // int(self.args.num_generations)
        n_rows = self._with_eval(max(64, need * (self.recipe.steps + 1)))
        trainer = self.recipe.trainer_kwargs()
        env = None
        if self.recipe.env is not None:
            env, self.dataset = load_env_checked(self.recipe, trainer, need=need, n_rows=n_rows)
            flag = f"--env {self.recipe.env!r}"
        else:
            self.dataset = load_dataset_checked(self.recipe, need=need, n_rows=n_rows)
            flag = f"--dataset_name {self.recipe.dataset!r}" if self.recipe.dataset else "the embedded task"
        check_prompt_lengths(self.recipe, self.args, self.dataset, flag)
        self._hold_out_eval(need, flag)
        self._rewards_and_hint(env)
        hints = env is not None or self.recipe.dataset is None or self.hint is not None
        chosen, self.channel_line = choose_channels(trainer, set(self.dataset.column_names), hints=hints)
        self.config = self._config({**trainer, **chosen})
        from composer_trl.trainer import check_channel_inputs, dataset_columns

        try:  # before the model loads; the trainer finds this config and these columns checked
            check_channel_inputs(
                self.config, dataset_columns(self.dataset), hint_fn=self._hint_fn() is not None
            )
        except ValueError as e:
            raise UsageError(str(e).strip().splitlines()[0]) from e

    def _config(self, trainer: dict[str, Any]) -> Any:
        from composer_trl.config import ComposerGRPOConfig

        return build(ComposerGRPOConfig, {**self.run_args, **trainer})

    def _rewards_and_hint(self, env: Any) -> None:
        if env is not None:  # the environment's reward, and its feedback as the hint
            from composer_core.envs import env_hint_func, env_reward_func

            self.rewards, self.hint = [env_reward_func(env)], env_hint_func(env)
            return
        try:
            self.rewards = [import_callable(r, "reward_funcs") for r in (self.recipe.reward or [])]
            self.hint = import_callable(self.recipe.hint_fn, "hint_fn") if self.recipe.hint_fn else None
        except ValueError as e:
            raise UsageError(str(e)) from e

    @property
    def evaluates(self) -> bool:
        strategy = self.args.eval_strategy
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

    def checkpoint_parts(self) -> tuple[str, ...]:
        """Files a complete checkpoint holds besides TRL's own (an ema/base SDPO teacher's weights)."""
        from composer_core.sdpo import TEACHER_STATE_FILE

        c = self.config
        teacher = c.alpha_sdpo > 0 and c.teacher_weights_options.sdpo_teacher != "live"
        return (TEACHER_STATE_FILE,) if teacher else ()

    def _hint_fn(self) -> Any:
        """The hint callable the trainer gets (None: none is read)."""
        from composer_core.tasks.digit_reversal import reverse_hints

        c = self.config
        if c.alpha_sdpo == 0 or c.teacher_context_options.sdpo_teacher_context == "success":
            return None
        embedded = self.recipe.dataset is None and self.recipe.env is None
        return self.hint or (reverse_hints if embedded else None)

    def make_trainer(self, model: Any, tok: Any) -> Any:
        """``ComposerGRPOTrainer`` over the checked data (it checks each channel's inputs, once)."""
        from composer_core.tasks.digit_reversal import reverse_reward
        from trl import get_peft_config

        from composer_trl.trainer import ComposerGRPOTrainer

        c, extra, hint = self.config, {}, self._hint_fn()
        if hint is not None:
            extra["hint_fn"] = hint
        peft_config = get_peft_config(model_config(self.recipe))  # TRL's own LoRA config (--use_peft ...)
        if peft_config is not None:
            extra["peft_config"] = peft_config
        rewards = list(self.rewards) or [reverse_reward]
        return ComposerGRPOTrainer(
            model=model,
            reward_funcs=rewards,
            args=c,
            train_dataset=self.dataset,
            eval_dataset=self.eval_dataset,
            processing_class=tok,
            **extra,
        )

    def run(self, *, resume: str | None = None) -> dict[str, Any]:
        """Train (from ``resume``: ``last`` or a checkpoint path); the result row of summary.json."""
        from transformers import PrinterCallback, ProgressCallback

        if self.config is None:
            self.check()
        # an ema/base SDPO teacher's weights are part of a complete checkpoint
        ckpt = resolve_checkpoint(resume, self.trainer_dir, self.checkpoint_parts()) if resume else None
        model, tok = load_model(self.recipe)
        if self.channel_line:
            print(self.channel_line, file=sys.stderr)
        try:
            trainer = self.make_trainer(model, tok)
        except ValueError as e:  # the trainer's checks (a channel without its inputs, ...): one line, exit 2
            raise UsageError(str(e).strip().splitlines()[0]) from e
        for printer in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(printer)
        stop = StopOnSignal()
        resume_step = checkpoint_step(ckpt) if ckpt is not None else None
        metrics = MetricsJSONL(self.metrics_path, resume_step=resume_step)
        progress = ProgressBar(self.name)
        cbs = [ComposerState(trainer, ckpt), stop, metrics, progress]
        for cb in cbs:
            trainer.add_callback(cb)
        start = time.perf_counter()
        stop.install()
        try:
            trainer.train(resume_from_checkpoint=str(ckpt) if ckpt else None)
        finally:
            stop.uninstall()
            if progress.bar is not None:  # a run that raised: its bar erased, the error not glued to it
                progress.bar.leave = False
                progress.bar.close()
        seconds = time.perf_counter() - start
        return self._result(trainer, tok, stop, seconds)

    def save(self, trainer: Any, tok: Any) -> str:
        """The trained model, its tokenizer and model card in ``out/model``."""
        folder = self.out / "model"
        trainer.save_model(str(folder))
        tok.save_pretrained(str(folder))
        write_model_card(trainer, folder, self.recipe)
        return str(folder)

    def _result(self, trainer: Any, tok: Any, stop: Any, seconds: float) -> dict[str, Any]:
        step = int(trainer.state.global_step)
        result: dict[str, Any] = {"seconds": seconds, "metrics": str(self.metrics_path), "global_step": step}
        result.update(signal=stop.received, exit_code=stop.code, checkpoint=None, model=None)
        if stop.received:
            result["checkpoint"] = str(self.trainer_dir / f"checkpoint-{step}")
        else:
            result["model"] = self.save(trainer, tok)
        rewards = [r["reward"] for r in read_jsonl(self.metrics_path) if r.get("reward") is not None]
        k = max(1, len(rewards) // 10)
        result["reward_start"] = sum(rewards[:k]) / k if rewards else None
        result["reward_end"] = sum(rewards[-k:]) / k if rewards else None
        return result
