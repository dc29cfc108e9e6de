"""Block partitioning and the few collectives the engine needs (no-ops in one process).

The schedule (a forward-only wavefront, one non-blocking send in flight per link): the README's "Several
processes". Decisions (skip, resume point, best) are made on rank 0 and broadcast. Tensors live on
:attr:`DistContext.device` (CPU with gloo, ``cuda:<LOCAL_RANK>`` with NCCL).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: torch.distributed.nn binds ``group.WORLD`` as a default
# argument, so imported after init (torch._dynamo does, from the optimizer step) it would keep the default group
# alive past destroy_process_group and its gloo threads would die in interpreter teardown (SIGABRT). Every
# script that imports the engine before ``init_process_group`` (the CLI, a user's torchrun script) is covered.
import torch.distributed.nn
from torch import Tensor

T = TypeVar("T")


class PeerDiedError(RuntimeError):
    """A collective failed because another rank's process is gone; the message names it."""


def partition_blocks(num_blocks: int, world_size: int) -> list[range]:
    """Contiguous block ranges per rank; the first ``num_blocks % world_size`` ranks get one more.

    Raises the same ``ValueError`` on every rank when there are more ranks than blocks, before
    any collective, so no rank waits on another.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_blocks < world_size:
        raise ValueError(
            f"world_size={world_size} exceeds the number of blocks ({num_blocks}): every rank needs at least "
            f"one block; run with at most {num_blocks} processes"
        )
    base, extra = divmod(num_blocks, world_size)
    starts = [r * base + min(r, extra) for r in range(world_size + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(world_size)]


@dataclass(frozen=True)
class Ownership:
    """What rank ``rank`` of ``world_size`` holds: its blocks, the embedding (first rank), the head (last)."""

    rank: int
    world_size: int
    num_blocks: int
    blocks: tuple[int, ...]

    @staticmethod
    def of(num_blocks: int, rank: int = 0, world_size: int = 1) -> Ownership:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}")
        return Ownership(rank, world_size, num_blocks, tuple(partition_blocks(num_blocks, world_size)[rank]))

    @property
    def embed(self) -> bool:
        return self.rank == 0

    @property
    def head(self) -> bool:
        return self.rank == self.world_size - 1


@dataclass(frozen=True)
class DistContext:
    """Rank/world of this process; ``active`` when torch.distributed is initialised."""

    rank: int = 0
    world_size: int = 1
    active: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _pending: list[Any] = field(default_factory=list, compare=False, repr=False)

    @staticmethod
    def current() -> DistContext:
        if not (dist.is_available() and dist.is_initialized()):
            return DistContext()
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if nccl else torch.device("cpu")
        return DistContext(dist.get_rank(), dist.get_world_size(), True, device)

    def ownership(self, num_blocks: int) -> Ownership:
        return Ownership.of(num_blocks, self.rank, self.world_size)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.active:
            self.flush_sends()
            dist.barrier()

    def run_on_main(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 and broadcast its result; an error there is raised on every rank (no hang)."""
        if not self.active:
            return fn()
        result: tuple[bool, Any] = (True, None)
        if self.is_main:
            try:
                result = (True, fn())
            except (ValueError, OSError) as exc:
                result = (False, f"{type(exc).__name__}: {exc}")
        box = [result]
        dist.broadcast_object_list(box, src=0)
        ok, value = box[0]
        if not ok:
            raise ValueError(f"rank 0 failed: {value}")
        return value  # type: ignore[no-any-return]

    def run_everywhere(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if any rank fails, every rank raises (the first failure's message)."""
        if not self.active:
            return fn()
        try:
            value, error = fn(), None
        except (ValueError, OSError) as exc:
            value, error = None, f"rank {self.rank} failed: {type(exc).__name__}: {exc}"
        errors = [e for e in self.gather(error) if e]
        if errors:
            raise ValueError(errors[0])
        return value  # type: ignore[return-value]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (list indexed by rank) on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def recv_from_previous(self, like: Tensor) -> Tensor:
        """Receive the hidden state from rank ``r − 1`` (shape/dtype of ``like``, on this rank's device)."""
        if not self.active or self.rank == 0:
            return like
        buf = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        dist.recv(buf, src=self.rank - 1)
        return buf

    def send_to_next(self, hidden: Tensor) -> None:
        """Non-blocking send to rank ``r + 1``; waits for the previous send first (one in flight)."""
        if self.active and self.rank < self.world_size - 1:
            self.flush_sends()
            payload = hidden.detach().contiguous()
            self._pending.append((dist.isend(payload, dst=self.rank + 1), payload))

    def flush_sends(self) -> None:
        """Wait until every hidden state sent by this rank has been received."""
        while self._pending:
            work, _payload = self._pending.pop(0)
            work.wait()

    def processes(self) -> list[tuple[str, int]]:
        """(host name, pid) of every rank (list indexed by rank): what :meth:`raise_if_peer_died` checks."""
        return self.gather((socket.gethostname(), os.getpid()))

    def raise_if_peer_died(self, processes: Sequence[tuple[str, int]], wait_s: float = 2.0) -> None:
        """After a failed collective: :class:`PeerDiedError` naming the ranks on this host whose process is
        gone (dead or a zombie; polled up to ``wait_s``). Ranks on other hosts cannot be checked from here."""
        host = socket.gethostname()
        deadline = time.monotonic() + wait_s
        while True:
            gone = [r for r, (h, pid) in enumerate(processes) if r != self.rank and h == host and _gone(pid)]
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if gone:
            names = ", ".join(f"rank {r} (host {processes[r][0]}, pid {processes[r][1]})" for r in gone)
            raise PeerDiedError(
                f"{names} died (killed or crashed), so rank {self.rank} stopped; "
                "rerun every rank to resume from the last complete checkpoint"
            )


def _gone(pid: int) -> bool:
    """The process has exited (or is a zombie nobody reaped yet)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:  # Linux: the state is the field after "(comm)"
            stat = f.read()
    except ProcessLookupError:
        return True
    except OSError:  # another user's process, or no /proc: alive as far as we can tell
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")
