"""Replica programs for the fault-tolerant launcher tests (this folder on the replicas' ``PYTHONPATH``)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from composer_diloco import toy


def ft_replica_exiting_early(*, exit_after_sync: int, **kw: Any) -> dict[str, Any]:
    """:func:`composer_diloco.toy.ft_replica` whose script calls ``sys.exit(0)`` once sync ``exit_after_sync``
    is done, before its function returns (before its ``max_syncs``)."""
    train = toy.train_diloco

    def train_then_exit(model: Any, opt: Any, manager: Any, *args: Any, on_step: Any, **kwargs: Any) -> Any:
        def step(i: int, loss: float) -> None:
            on_step(i, loss)
            if manager.current_step() >= exit_after_sync:
                print(f"exiting early with status 0 after sync {manager.current_step()}", flush=True)
                sys.exit(0)

        return train(model, opt, manager, *args, on_step=step, **kwargs)

    toy.train_diloco = train_then_exit  # type: ignore[assignment]
    return toy.ft_replica(**kw)


def gated_ft_replica(*, gates: dict[str, str], **kw: Any) -> dict[str, Any]:
    """:func:`composer_diloco.toy.ft_replica` that logs ``start_quorum at step <n>`` and, for each global step
    (a string) in ``gates``, waits for that file once it has reached that step (step 0: before training)."""
    train, pending = toy.train_diloco, dict(gates)

    def wait_gate(step: int) -> None:
        path = pending.pop(str(step), None)
        while path is not None and not os.path.exists(path):
            time.sleep(0.05)

    def gated_train(model: Any, opt: Any, manager: Any, *args: Any, on_step: Any, **kwargs: Any) -> Any:
        start_quorum, synced = manager.start_quorum, [0]

        def logged_start_quorum(*a: Any, **k: Any) -> Any:
            print(f"start_quorum at step {manager.current_step()}", flush=True)
            return start_quorum(*a, **k)

        def step(i: int, loss: float) -> None:
            on_step(i, loss)
            if manager.current_step() > synced[0]:
                synced[0] = manager.current_step()
                wait_gate(synced[0])

        manager.start_quorum = logged_start_quorum
        wait_gate(0)
        return train(model, opt, manager, *args, on_step=step, **kwargs)

    toy.train_diloco = gated_train  # type: ignore[assignment]
    return toy.ft_replica(**kw)
