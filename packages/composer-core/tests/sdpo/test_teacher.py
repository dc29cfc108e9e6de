"""The SDPO teacher's weights: the EMA step's closed form, parameter matching, checkpoint round trips."""

from __future__ import annotations

import pytest
import torch
from composer_core.sdpo import (
    TEACHER_STATE_FILE,
    TeacherWeightsOptions,
    ema_update_,
    frozen_copy,
    load_teacher,
    save_teacher,
)
from torch import nn


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight  # tied, as most LMs' heads are


def test_ema_equals_the_closed_form_over_steps_in_float32_bit_for_bit() -> None:
    torch.manual_seed(0)
    student = _Tied()
    teacher = frozen_copy(student)
    expected = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    for _ in range(4):
        with torch.no_grad():
            for p in student.parameters():
                p.add_(torch.randn_like(p))
        ema_update_(teacher, student, 0.3)
        for n, s in student.named_parameters():
            expected[n] = expected[n].mul_(1 - 0.3).add_(s.detach(), alpha=0.3)  # TRL's order of float ops
    for n, t in teacher.named_parameters():
        assert torch.equal(t, expected[n]), n
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training


def test_mismatched_parameters_raise_with_the_fix() -> None:
    with pytest.raises(ValueError, match="frozen_copy"):
        ema_update_(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3)), 0.5)


def test_weights_options_refuse_options_without_effect() -> None:
    assert TeacherWeightsOptions("ema", 0.1, 2).syncs_at(4) and not TeacherWeightsOptions(
        "ema", 0.1, 2
    ).syncs_at(3)
    assert not TeacherWeightsOptions("base").syncs_at(1)
    for kwargs, match in (
        ({"sdpo_teacher": "frozen"}, "not supported"),
        ({"sdpo_teacher": "ema", "teacher_update_rate": 0.0}, r"\(0, 1\]"),
        ({"sdpo_teacher": "ema", "teacher_sync_steps": 0}, ">= 1"),
        ({"sdpo_teacher": "live", "teacher_update_rate": 0.2}, "act only with sdpo_teacher='ema'"),
        ({"sdpo_teacher": "base", "teacher_sync_steps": 3}, "act only with sdpo_teacher='ema'"),
    ):
        with pytest.raises(ValueError, match=match):
            TeacherWeightsOptions(**kwargs)


def test_save_and_load_round_trip_with_tied_weights_and_bad_files(tmp_path) -> None:
    torch.manual_seed(1)
    teacher = _Tied()
    path = save_teacher(teacher, tmp_path)
    assert path.endswith(TEACHER_STATE_FILE)
    other = _Tied()
    load_teacher(other, tmp_path)
    for (n, a), (_, b) in zip(teacher.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
    assert other.head.weight is other.emb.weight
    with pytest.raises(FileNotFoundError, match="holds no SDPO teacher"):
        load_teacher(other, tmp_path / "elsewhere")
    (tmp_path / TEACHER_STATE_FILE).write_bytes((tmp_path / TEACHER_STATE_FILE).read_bytes()[:40])
    with pytest.raises(ValueError, match="not a readable SDPO teacher checkpoint"):
        load_teacher(other, tmp_path)
