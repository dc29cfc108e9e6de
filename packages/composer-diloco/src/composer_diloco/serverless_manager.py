"""ObjectStoreManager: the part of ``torchft.Manager``'s interface that torchft's ``DiLoCo``
uses, backed by :class:`~composer_diloco.object_store.ObjectStoreAllReduce`.

torchft's DiLoCo calls, in order: ``register_state_dict_fn`` (construction),
``disallow_state_dict_read`` / ``allow_state_dict_read`` (around every inner step),
``start_quorum`` → ``current_step`` → ``allreduce(t, should_quantize=…)`` for each parameter or
bucket (then ``Work.wait`` / ``Work.get_future().then``), ``should_commit``, and reads
``_use_async_quorum``. All of them are implemented here; the rest of the Manager surface that
user loops commonly touch (``num_participants``, ``participating_rank``, ``is_participating``,
``batches_committed``, ``errored``/``report_error``, ``state_dict``/``load_state_dict``,
``wrap_future``, ``wait_quorum``, ``shutdown``) is implemented too.

A round = one DiLoCo fragment sync = one manager step. ``allreduce`` only queues its tensor;
the queued tensors of a round travel in **one** object. The upload starts in a background
thread as soon as the next inner step begins (so ``fragment_sync_delay`` really overlaps the
exchange with τ inner steps) or when DiLoCo first waits on the result, whichever comes first.

Rounds follow the store's invariant: every replica that completes round r applies the same
average, or fails with an error naming why. A replica restored from a checkpoint
(``load_state_dict`` + the registered user state) that re-runs rounds already committed adopts
their committed averages, never recomputes them; one more than ``keep_rounds`` rounds behind (its
round cleaned up, or the round's manifest deleted) gets
:class:`~composer_diloco.object_store.RoundExpiredError` from ``Work.wait`` / ``should_commit``
and must restart from a checkpoint of the run's current round.

Not supported here: healing. A replica that restarts cannot fetch the current global state
from the store (use the fault-tolerant mode, :mod:`composer_diloco.fault_tolerant`, for that).
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

    def __init__(self, manager: ObjectStoreManager, tensor: torch.Tensor) -> None:
        super().__init__()
        self._manager = manager
        self._tensor = tensor
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
        load_state_dict / state_dict: optional user state functions (registered as ``"default"``,
            as torchft does; kept for API parity, they are not used for healing).
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
        self._errored: Exception | None = None
        self._in_round = False
        self._pending: list[tuple[torch.Tensor, bool, Any, _RoundWork]] = []
        self._exchange: ThreadFuture[RoundStats] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco_exchange")
        self._lock = threading.Lock()
        self._load_fns: dict[str, Callable[[Any], None]] = {}
        self._save_fns: dict[str, Callable[[], Any]] = {}
        self._state_dict_read_allowed = True
        self.history: list[RoundStats] = []
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

    # ---- state dict bookkeeping (torchft API) ------------------------------------------
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        if key in self._load_fns:
            raise ValueError(f"state dict key {key!r} is already registered.")
        self._load_fns[key] = load_state_dict
        self._save_fns[key] = state_dict

    def allow_state_dict_read(self) -> None:
        self._state_dict_read_allowed = True

    def disallow_state_dict_read(self) -> None:
        # An inner step begins: everything DiLoCo queued for this round is final -> upload now.
        self._state_dict_read_allowed = False
        self._launch_exchange()

    def user_state_dict(self) -> dict[str, Any]:
        """Every registered state (e.g. DiLoCo's global copy and outer optimiser), for checkpoints."""
        return {key: fn() for key, fn in self._save_fns.items()}

    def load_user_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted(set(self._load_fns) - set(state))
        if missing:
            raise ValueError(f"checkpoint lacks registered state {missing}.")
        for key, fn in self._load_fns.items():
            fn(state[key])

    def state_dict(self) -> dict[str, int]:
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    # ---- quorum / round ---------------------------------------------------------------
    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Open round ``current_step()``: every replica is expected (serverless has no membership)."""
        if self._in_round:
            raise RuntimeError("start_quorum called twice without should_commit in between.")
        self._in_round = True
        self._errored = None

    def wait_quorum(self) -> None:
        if not self._in_round:
            raise RuntimeError("must call start_quorum before wait_quorum.")

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
                "allreduce after this round's exchange started; queue all tensors of a round first."
            )
        work = _RoundWork(self, tensor)
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
            with self._lock:
                self._exchange, self._pending = None, []
            self._in_round = False
            raise
        self.history.append(stats)
        for tensor, _, _, work in pending:
            if not work._future.done():
                work._future.set_result(tensor)
        with self._lock:
            self._exchange, self._pending = None, []

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Finish the round; True unless an error was reported. Advances ``current_step()``."""
        self._finish_round()
        self._in_round = False
        if self._errored is not None:
            return False
        self._step += 1
        self._batches_committed += self.num_participants()
        return True

    # ---- read-only views --------------------------------------------------------------
    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def num_participants(self) -> int:
        last = self.store.last
        return len(last.participants) if last.round >= 0 else self.store.world_size

    def participating_rank(self) -> int | None:
        last = self.store.last
        if last.round >= 0 and self.store.rank not in last.participants:
            return None
        return self.store.rank

    def is_participating(self) -> bool:
        return self.participating_rank() is not None

    def errored(self) -> Exception | None:
        return self._errored

    def report_error(self, e: Exception) -> None:
        self._errored = e

    def wrap_future(
        self, fut: torch.futures.Future[Any], default: Any, timeout: timedelta | None = None
    ) -> torch.futures.Future[Any]:
        def callback(f: torch.futures.Future[Any]) -> Any:
            try:
                return f.value()
            except Exception as exc:
                self.report_error(exc)
                return default

        return fut.then(callback)

    def shutdown(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait)
