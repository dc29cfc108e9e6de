"""The arithmetic of a round: ``Σ x_r`` in float32 in rank order, then ``/ n`` for an average (torchft's gloo
order), shared by both exchanges; an element whose float32 sum overflows gets its float64-summed average."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch._C._nn import flatten_dense_tensors, unflatten_dense_tensors

from .codec import Decoded, all_finite
from .errors import ObjectStoreError

_T = TypeVar("_T")
REDUCE_PIECE = 1 << 17  # float32 elements of the scratch a full-exchange average goes through
_BUCKET_TENSOR = 1 << 15  # float32 targets up to this size are averaged several at a time


def piece(t: torch.Tensor, s: int, k: int) -> torch.Tensor:
    """Shard ``s`` of ``k`` of a tensor: a contiguous 1/k slice of its flattened values (a view)."""
    flat = t.reshape(-1)
    n = flat.numel()
    return flat[n * s // k : n * (s + 1) // k]


def sum_into(outs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], op: str) -> list[bool]:
    """``outs[i] = Σ_r inputs[r][i]`` in float32 in the given order, then ``/ n`` for avg, mended
    (:func:`_mend`). Returns whether each result is finite."""
    divisor = len(inputs) if op == "avg" else 1
    finite = []
    for i, out in enumerate(outs):
        fix = _average_into(out, [x[i] for x in inputs], divisor)
        finite.append(fix is None or bool(torch.isfinite(fix[1]).all()))
    return finite


def _average_into(
    out: torch.Tensor, inputs: Sequence[torch.Tensor], divisor: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    _sum(out, inputs)
    fix = _mend(out, inputs, divisor)
    if divisor > 1:
        out.div_(divisor)
    if fix is not None:
        out[fix[0]] = fix[1]
    return fix


def _sum(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> None:
    first, rest = inputs[0].reshape(-1), [x.reshape(-1) for x in inputs[1:]]
    if rest and first.dtype == rest[0].dtype == torch.float32:
        torch.add(first, rest[0], out=out)  # one pass instead of copy + add
        rest = rest[1:]
    else:
        out.copy_(first)
    for x in rest:
        out.add_(x)


def _mend(
    acc: torch.Tensor, inputs: Sequence[torch.Tensor], divisor: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where the float32 sums ``acc`` overflowed: (those indices, ``Σ inputs / divisor`` there summed in
    float64), or None. Elementwise: the result does not depend on how tensors are cut into pieces or shards."""
    if all_finite(acc):
        return None
    where = torch.isfinite(acc).logical_not_().nonzero().view(-1)
    wide = torch.zeros(where.numel(), dtype=torch.float64)
    for x in inputs:
        wide += x.reshape(-1)[where].to(torch.float64)
    return where, (wide / divisor).to(torch.float32)


def overflow_message(round_id: int, what: str, op: str) -> str:
    if op == "avg":  # only float64 contributions beyond float32's range get here
        fix = "the exchange averages in float32: keep float64 tensors within float32's range (±3.4e38)."
    else:
        fix = (
            "scale the tensors down, or use op='avg' (an average of finite float32 values is always applied)."
        )
    return (
        f"round {round_id}: {what} is finite in every contribution but their sum overflows float32 (op={op!r}); "
        f"no replica applies it and no tensor changed: {fix}"
    )


def direct_targets(tensors: Sequence[torch.Tensor]) -> set[int]:
    """Indices of the contiguous, non-float64 CPU targets whose memory no other target shares: those can be
    written while later targets' inputs are still read (a float64 one's average may overflow float32)."""
    owners: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        owners.setdefault(t.data_ptr() - int(t.storage_offset()) * t.element_size(), []).append(i)
    return {
        i
        for i, t in ((ix[0], tensors[ix[0]]) for ix in owners.values() if len(ix) == 1)
        if t.is_cpu and t.is_contiguous() and t.dtype != torch.float64
    }


def reduce_pieces(
    t: torch.Tensor, inputs: Sequence[torch.Tensor], divisor: int, scratch: torch.Tensor
) -> None:
    """``t ← Σ inputs / divisor`` piece by piece through the cache-sized float32 ``scratch`` (an input may
    be ``t`` itself: each piece is read before it is written)."""
    flat, flats = t.view(-1), [x.reshape(-1) for x in inputs]
    for lo in range(0, flat.numel(), REDUCE_PIECE):
        hi = min(lo + REDUCE_PIECE, flat.numel())
        piece, column = scratch[: hi - lo], [x[lo:hi] for x in flats]
        _sum(piece, column)
        fix = _mend(piece, column, divisor)  # before the write below: an input may be t
        apply(flat[lo:hi], piece, divisor)
        if fix is not None:
            flat[lo:hi][fix[0]] = fix[1].to(t.dtype)


def bucketable(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    return (
        t.numel() <= _BUCKET_TENSOR
        and t.dtype == torch.float32
        and all(x.dtype == torch.float32 and x.is_cpu for x in inputs)
    )


def runs(items: Sequence[_T], sizes: Sequence[int], limit: int) -> list[list[_T]]:
    """``items`` cut, in order, into runs whose ``sizes`` add up to at most ``limit``."""
    out: list[list[_T]] = []
    total = 0
    for item, n in zip(items, sizes):
        if not out or total + n > limit:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n
    return out


def reduce_bucket(
    targets: Sequence[torch.Tensor],
    columns: Sequence[Sequence[torch.Tensor]],
    divisor: int,
    scratch: torch.Tensor,
) -> None:
    """``targets[j] ← Σ_r columns[r][j] / divisor`` for small float32 targets, flattened into one buffer
    (one call each, not one per tensor); the same bits as :func:`reduce_pieces`."""
    flats = [flatten_dense_tensors(list(column)) for column in columns]  # reads the targets before any write
    piece = scratch[: flats[0].numel()]
    _average_into(piece, flats, divisor)
    torch._foreach_copy_(list(targets), unflatten_dense_tensors(piece, list(targets)))


def apply(t: torch.Tensor, acc: torch.Tensor, divisor: int) -> None:
    """``t ← acc / divisor`` (float32 division, then cast to t's dtype/device)."""
    if divisor == 1:
        t.copy_(acc.view(t.shape))
    elif t.dtype == torch.float32 and t.is_cpu and t.is_contiguous():
        torch.div(acc, divisor, out=t.view(-1))
    else:
        t.copy_(acc.div_(divisor).view(t.shape))


def check_layouts(
    decoded: Mapping[int, Decoded], ranks: Sequence[int], tensors: Sequence[torch.Tensor], round_id: int
) -> None:
    """Every participant sent the same tensors, and the caller's have their shapes (e.g. when adopting)."""

    def shapes(r: int) -> list[tuple[Any, ...]]:
        meta = decoded[r].meta
        layout = meta["tensors"] if meta.get("kind") == "index" else meta["layout"]
        return [(tuple(e["shape"]), e["dtype"], e["wire"]) for e in layout]

    ref_rank = ranks[0]
    ref = shapes(ref_rank)
    for r in ranks[1:]:
        if shapes(r) != ref:
            raise ObjectStoreError(
                f"round {round_id}: rank {r} sent tensors {shapes(r)} but rank {ref_rank} sent {ref}; "
                "every replica must all-reduce the same parameters in the same order (same model, same fragments)."
            )
    want, mine = [shape for shape, _, _ in ref], [tuple(t.shape) for t in tensors]
    if want != mine:
        raise ObjectStoreError(
            f"round {round_id} was committed with tensors of shapes {want} but this replica passes "
            f"{mine}; every replica must all-reduce the same parameters in the same order."
        )
