"""Fixtures shared by the loss tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


@pytest.fixture
def chunk_widths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every chunk the full-vocabulary engine gathers (student and teacher rows alike), in
    order: a spy on ``engine._rows_into``. Clear it between runs of one test."""
    from composer_core.loss import engine

    widths: list[int] = []
    real = engine._rows_into

    def spy(src: torch.Tensor, idx: object, out: torch.Tensor) -> torch.Tensor:
        widths.append(out.shape[0])
        return real(src, idx, out)

    monkeypatch.setattr(engine, "_rows_into", spy)
    return widths


@pytest.fixture
def force_accelerator(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call it to take the accelerator path on the CPU: ``host_reads_are_free`` patched to False where the
    engine (:mod:`composer_core.loss.engine`) and the wrappers' kernels (through ``validation``) look it up."""
    from composer_core.loss import engine, validation

    def force() -> None:
        for module in (validation, engine):
            monkeypatch.setattr(module, "host_reads_are_free", lambda device: False)

    return force
