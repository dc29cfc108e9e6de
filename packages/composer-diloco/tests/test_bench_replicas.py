"""The throughput bench's replica processes (``bench/bench_diloco.py``): a replica that fails or dies ends the
bench at once with its rank named, never a wait on the barrier or the result queue, and leaves no process."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH_DIR))  # spawned replicas import the bench by name from sys.path
    return importlib.import_module("bench_diloco")


def _kwargs(tmp_path: Path, numel: int, reps: int) -> dict[str, Any]:
    return {"url": f"file://{tmp_path}/store", "run": "r", "numel": numel, "reps": reps, "options": None}


def test_a_replica_that_raises_is_named_with_its_traceback(bench: ModuleType, tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"throughput replica [01] failed:(.|\n)*Traceback"):
        bench._run_replicas(_kwargs(tmp_path, numel=-1, reps=1))  # torch.randn(-1) raises in both replicas
    assert time.monotonic() - started < 120
    assert not multiprocessing.active_children()


def test_a_killed_replica_ends_the_wait_at_once(bench: ModuleType, tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            bench._run_replicas(_kwargs(tmp_path, numel=1024, reps=10**6))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)  # on a failure here, pytest still exits
    thread.start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "store" / "r" / "progress").is_dir():  # both replicas are in their rounds
        assert time.monotonic() < deadline and thread.is_alive(), errors
        time.sleep(0.05)
    victim = multiprocessing.active_children()[0]
    os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
    thread.join(60)
    assert not thread.is_alive(), "the bench kept waiting for a replica that was killed"
    assert len(errors) == 1 and "exited with code -9 without a result" in str(errors[0]), errors
    assert not multiprocessing.active_children()  # the surviving replica was stopped too
