"""Training callbacks of ``composer-train``: a tqdm bar and a metrics JSONL file.

Both read TRL's logged metrics (``on_log``), so they work for ``ComposerGRPOTrainer`` and plain
``GRPOTrainer`` alike (channels 2/3 simply do not appear for the latter).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import TrainerCallback

from composer_trl.lifecycle import dumps

BAR_FIELDS = {
    "reward": "reward",
    "composer/loss/policy": "policy",
    "composer/loss/sdpo": "sdpo",
    "composer/loss/replay": "replay",
}
"""Logged metric → short name shown on the progress bar."""


class ProgressBar(TrainerCallback):
    """One tqdm bar over optimiser steps showing the reward and each channel's loss."""

    def __init__(self, desc: str) -> None:
        self.desc = desc
        self.bar: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.bar = tqdm(total=state.max_steps, desc=self.desc, unit="step", dynamic_ncols=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any
    ) -> None:
        if self.bar is not None and logs:
            shown = {short: f"{logs[k]:.3f}" for k, short in BAR_FIELDS.items() if k in logs}
            if shown:
                self.bar.set_postfix(shown, refresh=False)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class MetricsJSONL(TrainerCallback):
    """Appends one JSON object per logging step (``step`` + every numeric metric TRL logged) to ``path``, and one per
    evaluation (``--eval_strategy``: ``step`` + TRL's ``eval_*`` metrics, ``eval_reward`` among them).

    Every line is strict JSON: a non-finite value is written as ``null`` and its key listed under
    ``"nonfinite"``. ``resume_step=None`` starts a fresh file; ``resume_step=N`` (resuming from the
    checkpoint of step N) keeps the rows up to step N, drops the ones a killed run logged after it, and
    appends from there, so the file holds each step once.
    """

    def __init__(self, path: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None or not self.path.is_file():
            self.path.write_text("")
        else:
            kept = [line for line in self.path.read_text().splitlines() if _step(line) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any
    ) -> None:
        if not logs or ("reward" not in logs and "eval_reward" not in logs):  # skip the train_runtime summary
            return
        row: dict[str, Any] = {"step": state.global_step}
        for k, v in logs.items():
            if isinstance(v, int | float):
                row[k] = float(v)
        with self.path.open("a") as f:
            f.write(dumps(row) + "\n")


def _step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn last line of a killed run: dropped


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows written by :class:`MetricsJSONL`."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
