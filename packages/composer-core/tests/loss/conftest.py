"""Fixtures shared by the loss tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def chunk_widths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every chunk the full-vocabulary engine gathers (student and teacher rows alike), in
    order: a spy on ``distill._rows_into``. Clear it between runs of one test."""
    from composer_core.loss import distill

    widths: list[int] = []
    real = distill._rows_into

    def spy(src: torch.Tensor, idx: object, out: torch.Tensor) -> torch.Tensor:
        widths.append(out.shape[0])
        return real(src, idx, out)

    monkeypatch.setattr(distill, "_rows_into", spy)
    return widths
