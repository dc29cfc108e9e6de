"""ObjectStoreManager: the part of ``torchft.Manager``'s interface that torchft's ``DiLoCo`` calls
(``register_state_dict_fn``, ``allow``/``disallow_state_dict_read``, ``start_quorum``, ``current_step``,
``allreduce``, ``should_commit``, ``_use_async_quorum``), backed by
:class:`~composer_diloco.object_store.ObjectStoreAllReduce`.

A round = one DiLoCo fragment sync = one manager step, its queued tensors in **one** object, uploaded in a
background thread when the next inner step begins or DiLoCo first waits. Errors of a round (README, "Serverless
mode") surface from ``Work.wait`` / ``should_commit``. No healing: use the fault-tolerant mode for that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .object_store import ObjectStoreAllReduce, RoundStats


class _RoundWork(dist._Work):  # type: ignore[name-defined, misc]
    """A ``Work`` whose result arrives when the round's exchange finishes."""

    def __init__(self, manager: ObjectStoreManager) -> None:
        super().__init__()
        self._manager = manager
        self._future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._manager._finish_round()
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        return self._future


class ObjectStoreManager:
    """A serverless stand-in for ``torchft.Manager`` driving torchft's DiLoCo unchanged.

    Args:
        store: the replica's :class:`ObjectStoreAllReduce` (its rank/world size are the replica's).
        load_state_dict / state_dict: optional user state functions (registered as ``"default"``;
            not used for healing).
    """

    _use_async_quorum = False

    def __init__(
        self,
        store: ObjectStoreAllReduce,
        load_state_dict: Callable[[Any], None] | None = None,
        state_dict: Callable[[], Any] | None = None,
    ) -> None:
        self.store = store
        self._step = 0
        self._batches_committed = 0
        self._in_round = False
        self._pending: list[tuple[torch.Tensor, bool, Any, _RoundWork]] = []
        self._exchange: ThreadFuture[RoundStats] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco_exchange")
        self._lock = threading.Lock()
        self._state_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self.history: list[RoundStats] = []
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        if key in self._state_fns:
            raise ValueError(f"state dict key {key!r} is already registered.")
        self._state_fns[key] = (load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        self._launch_exchange()  # an inner step begins: everything queued for this round is final

    def state_dict(self) -> dict[str, int]:
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Open round ``current_step()``: every replica is expected (serverless has no membership)."""
        if self._in_round:
            raise RuntimeError("start_quorum called twice without should_commit in between.")
        self._in_round = True

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = ReduceOp.AVG
    ) -> _RoundWork:
        if not self._in_round:
            raise RuntimeError("allreduce outside a round: call start_quorum first (torchft's DiLoCo does).")
        if not torch.is_floating_point(tensor):
            raise ValueError("ObjectStoreManager.allreduce supports floating-point tensors only.")
        if reduce_op not in (ReduceOp.AVG, ReduceOp.SUM):
            raise ValueError(f"reduce_op must be ReduceOp.AVG or ReduceOp.SUM, got {reduce_op}.")
        if self._exchange is not None:
            raise RuntimeError(
                "allreduce after this round's exchange started; queue a round's tensors first."
            )
        work = _RoundWork(self)
        self._pending.append((tensor, bool(should_quantize), reduce_op, work))
        return work

    def _launch_exchange(self) -> None:
        with self._lock:
            if self._exchange is None and self._pending:
                self._exchange = self._executor.submit(self._run_exchange, list(self._pending), self._step)

    def _run_exchange(
        self, pending: list[tuple[torch.Tensor, bool, Any, _RoundWork]], round_id: int
    ) -> RoundStats:
        quantize = {q for _, q, _, _ in pending}
        ops = {op for _, _, op, _ in pending}
        if len(quantize) > 1 or len(ops) > 1:
            raise ValueError("one round must use a single should_quantize / reduce_op setting.")
        op: Literal["avg", "sum"] = "avg" if ops == {ReduceOp.AVG} else "sum"
        return self.store.allreduce(round_id, [t for t, _, _, _ in pending], quantize=quantize.pop(), op=op)

    def _finish_round(self) -> None:
        self._launch_exchange()
        with self._lock:
            exchange, pending = self._exchange, self._pending
        if exchange is None:
            return
        try:
            stats = exchange.result()
        except BaseException as exc:
            for _, _, _, work in pending:
                if not work._future.done():
                    work._future.set_exception(exc)  # type: ignore[arg-type]
            self._in_round = False
            raise
        finally:
            with self._lock:
                self._exchange, self._pending = None, []
        self.history.append(stats)
        for tensor, _, _, work in pending:
            if not work._future.done():
                work._future.set_result(tensor)

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Finish the round and advance ``current_step()``."""
        self._finish_round()
        self._in_round = False
        self._step += 1
        self._batches_committed += self.num_participants()
        return True

    def current_step(self) -> int:
        return self._step

    def num_participants(self) -> int:
        last = self.store.last
        return len(last.participants) if last.round >= 0 else self.store.world_size

    def shutdown(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait)
