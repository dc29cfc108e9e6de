"""Replica programs for the fault-tolerant launcher tests (this folder on the replicas' ``PYTHONPATH``)."""

from __future__ import annotations

import sys
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
