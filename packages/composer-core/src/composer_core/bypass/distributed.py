"""Block partitioning and the few collectives the engine needs (no-ops in one process).

Blocks are split contiguously: with ``L`` blocks and ``W`` ranks, rank ``r`` gets
``L // W`` blocks plus one more if ``r < L mod W``. Teacher activations flow rank to rank
(pipeline): rank ``r`` runs the teacher over its blocks and sends the hidden state to
``r + 1``. Decisions (skip, resume point, best) are made on rank 0 and broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

T = TypeVar("T")


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
    out, start = [], 0
    for r in range(world_size):
        size = base + (1 if r < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class DistContext:
    """Rank/world of this process; ``active`` when torch.distributed is initialised."""

    rank: int = 0
    world_size: int = 1
    active: bool = False

    @staticmethod
    def current() -> DistContext:
        if dist.is_available() and dist.is_initialized():
            return DistContext(dist.get_rank(), dist.get_world_size(), True)
        return DistContext()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

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
        ok, value = self.broadcast(result)
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
        """Receive the hidden state from rank ``r − 1`` (same shape/dtype as ``like``)."""
        if not self.active or self.rank == 0:
            return like
        buf = torch.empty_like(like)
        dist.recv(buf, src=self.rank - 1)
        return buf

    def send_to_next(self, hidden: Tensor) -> None:
        if self.active and self.rank < self.world_size - 1:
            dist.send(hidden.contiguous(), dst=self.rank + 1)
