"""The SDPO teacher's weights: the live student, a frozen copy of the initial model, or an EMA of the student.

``"live"``: the student itself, read without gradient; ``"base"``: the initial model, frozen (with PEFT, the base
with adapters off); ``"ema"``: ``θ_T ← (1 − τ)·θ_T + τ·θ_S`` every ``teacher_sync_steps`` optimiser steps, τ =
``teacher_update_rate`` (SDPO's default, arXiv 2601.20802 §3.2, TRL ``teacher_model_kind``), with TRL's order of
float ops (:func:`ema_update_`). :func:`save_teacher` / :func:`load_teacher` keep the teacher's weights with a
checkpoint, so a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from composer_core.loss.options import _non_default, _opt
from composer_core.loss.validation import check_choice, check_int

__all__ = [
    "TEACHER_KINDS",
    "TEACHER_STATE_FILE",
    "TeacherWeightsOptions",
    "ema_update_",
    "ema_update_tensors_",
    "frozen_copy",
    "load_teacher",
    "save_teacher",
]

TeacherKind = Literal["live", "ema", "base"]
TEACHER_KINDS: tuple[str, ...] = ("live", "ema", "base")
TEACHER_STATE_FILE = "composer_sdpo_teacher.safetensors"
"""The file a checkpoint keeps an ``ema``/``base`` teacher's weights in."""


@dataclass(frozen=True)
class TeacherWeightsOptions:
    """``sdpo_teacher`` (live | ema | base), ``teacher_update_rate`` τ and ``teacher_sync_steps`` (ema only)."""

    sdpo_teacher: TeacherKind = _opt(
        "live",
        "'live' (the student, no extra memory), 'ema' (an EMA of the student, one extra copy) or 'base' (the frozen initial model; with PEFT the base with adapters off).",
    )
    teacher_update_rate: float = _opt(0.05, "the EMA teacher's rate tau (sdpo_teacher='ema').")
    teacher_sync_steps: int = _opt(1, "the EMA teacher's update period in optimiser steps.")

    def __post_init__(self) -> None:
        check_choice("sdpo_teacher", self.sdpo_teacher, TEACHER_KINDS)
        rate = self.teacher_update_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 < float(rate) <= 1.0:
            raise ValueError(f"`teacher_update_rate`={rate!r} must lie in (0, 1] (the EMA rate τ).")
        steps = self.teacher_sync_steps
        check_int("teacher_sync_steps", steps, low=1)
        if self.sdpo_teacher != "ema" and (
            _non_default(self, "teacher_update_rate") or _non_default(self, "teacher_sync_steps")
        ):
            raise ValueError(
                f"`teacher_update_rate`={rate!r} / `teacher_sync_steps`={steps!r} act only with sdpo_teacher='ema' "
                f"(it is {self.sdpo_teacher!r}); select it or drop them."
            )

    def syncs_at(self, global_step: int) -> bool:
        """Whether the EMA teacher is updated after optimiser step ``global_step`` (1-based, as TRL counts)."""
        return self.sdpo_teacher == "ema" and global_step % self.teacher_sync_steps == 0


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in eval mode with every parameter frozen (the ``base``/``ema`` teacher)."""
    return copy.deepcopy(model).eval().requires_grad_(False)


@torch.no_grad()
def ema_update_(teacher: nn.Module, student: nn.Module, rate: float) -> None:
    """``θ_T ← (1 − rate)·θ_T + rate·θ_S`` in place, parameter by parameter (names must match)."""
    t_params = dict(teacher.named_parameters())
    s_params = dict(student.named_parameters())
    if t_params.keys() != s_params.keys():
        missing = sorted(set(s_params) ^ set(t_params))[:3]
        raise ValueError(
            f"the EMA teacher's parameters do not match the student's (first differences: {missing}); build the "
            "teacher with composer_core.sdpo.teacher.frozen_copy(student)."
        )
    ema_update_tensors_(((t, s_params[name]) for name, t in t_params.items()), rate)


@torch.no_grad()
def ema_update_tensors_(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], rate: float) -> None:
    """``t ← (1 − rate)·t + rate·s`` in place for each ``(t, s)`` pair (e.g. a PEFT teacher adapter's tensors and
    the student adapter's): the one EMA step every teacher uses."""
    for t, s in pairs:
        t.data.mul_(1.0 - rate).add_(s.data.to(t.dtype), alpha=rate)


def save_teacher(teacher: nn.Module, directory: str | os.PathLike[str]) -> str:
    """Write the teacher's weights to ``directory/TEACHER_STATE_FILE``; returns the path."""
    path = os.path.join(os.fspath(directory), TEACHER_STATE_FILE)
    save_model(teacher, path)
    return path


def load_teacher(teacher: nn.Module, directory: str | os.PathLike[str]) -> None:
    """Load ``directory/TEACHER_STATE_FILE`` into ``teacher`` (strict); a missing or corrupt file raises with the fix."""
    path = os.path.join(os.fspath(directory), TEACHER_STATE_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: this checkpoint holds no SDPO teacher (written before sdpo_teacher was set, or "
            "by another trainer); resume with the sdpo_teacher it was trained with, or start a new run."
        )
    try:
        load_model(teacher, path, strict=True, device=str(next(teacher.parameters()).device))
    except Exception as exc:  # safetensors raises its own error types for a truncated file
        raise ValueError(
            f"{path} is not a readable SDPO teacher checkpoint ({exc}); restore it or start anew."
        ) from exc
