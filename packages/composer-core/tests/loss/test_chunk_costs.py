"""What one call of the full-vocabulary JSD costs per chunk, measured on the CPU (issue 19, target 1).

- Extra memory at the default chunk: the bytes of every storage created during a fused forward + backward and
  alive at the same time, tracked op by op (:class:`LiveBytes`), against the documented budget (about four
  [rows, V] float buffers + a bool one, plus the gradients).
- Passes of the eager kernel over a chunk: operators that read or write a [c, V] tensor (the time above the
  matmul floor on a GPU is these passes; ``bench/bench_jsd.py``).
- Host reads of a direct call (outside ``compose_loss``'s fused check): one value check per call, not one per
  chunk (each read stalls the GPU's queue between chunks).
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from composer_core import fused_linear_generalized_jsd, generalized_jsd
from composer_core.loss.distill import (
    CHUNK_LOGITS,
    FUSED_CHUNK_LOGITS,
    FUSED_MIN_ROWS,
    chunk_rows,
    jsd_kernel,
)
from composer_testkit.host_reads import HOST_READS, RecordOps
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _tensor(t: object) -> bool:
    return isinstance(t, torch.Tensor)


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Peak bytes of the storages created inside the block that are alive at once (an operator's output that
    shares an input's storage, in place or ``out=``, is not a new one)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if _tensor(t)}
        for t in tree_flatten(out)[0]:
            if not _tensor(t):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or key in inputs or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)


class ChunkPasses(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Operators (not views, not allocations) that read or write a tensor of exactly ``numel`` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.numel = numel
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        touched = tree_flatten((args, kwargs, out))[0]
        allocates_or_aliases = func.is_view or "empty" in func.__name__
        if not allocates_or_aliases and any(_tensor(t) and t.numel() == self.numel for t in touched):
            self.ops.append(func.__name__)
        return out


V = 32_768


def test_default_rows_per_form_and_vocabulary() -> None:
    """Fused: 256 rows from V = 32,768 up (the matmuls keep an efficient height), FUSED_CHUNK_LOGITS // V below.
    Logits: CHUNK_LOGITS // V (the caller's [N, V] gradient dominates that form's memory; thinner chunks only
    cost time: 11.2 vs 8.9 ms eager, 8.6 vs 3.5 ms compiled at V = 32,768 on an H200, bench_jsd_cuda_logits256)."""
    assert (FUSED_MIN_ROWS, FUSED_CHUNK_LOGITS, CHUNK_LOGITS) == (256, 256 * 32_768, 1024 * 32_768)
    assert [chunk_rows(None, v, fused=True) for v in (32_768, 152_064, 262_144)] == [256, 256, 256]
    assert [chunk_rows(None, v, fused=True) for v in (8_192, 1_000)] == [1024, 8388]
    assert [chunk_rows(None, v, fused=False) for v in (32_768, 152_064)] == [1024, 220]
    assert chunk_rows(64, 152_064, fused=True) == chunk_rows(64, 152_064, fused=False) == 64


def test_fused_extra_memory_at_the_default_chunk_is_four_chunk_buffers() -> None:
    """V = 32,768, 1,024 tokens (4 default chunks): what a fused call holds beyond its inputs is its gradients
    plus 4¼ [256, V] float32 buffers (zs, zt, two work buffers, a bool mask), 136 MiB; a 1024-row default held
    546 MiB."""
    g = torch.Generator().manual_seed(0)
    n, h = 1024, 16
    with LiveBytes() as live:
        hs = torch.randn(n, h, generator=g).requires_grad_(True)
        w = torch.randn(V, h, generator=g).requires_grad_(True)
        fused_linear_generalized_jsd(hs, w, torch.randn(n, h, generator=g), beta=0.5).backward()
    grads = (n * h + V * h) * 4
    inputs = (3 * n * h + V * h) * 4  # created inside the block too
    extra = live.peak - inputs
    assert extra <= grads + 4.25 * 256 * V * 4 + 2**20, f"{extra / 2**20:.0f} MiB"


@pytest.mark.parametrize(("beta", "passes"), [(0.0, 7), (1.0, 8), (0.5, 14)])
def test_eager_kernel_passes_over_a_chunk(beta: float, passes: int) -> None:
    """log-softmax and exp of each side (4), then FKL: Σ p (lp − lq) and q − p (3); RKL: g, ⟨q, g⟩, g − ⟨q, g⟩,
    q ⊙ · (4); JSD: d, f (add, logaddexp, d == 0, masked fill), ⟨p, f⟩, g = d − f, ⟨q, g⟩, (1−β)(g − ⟨q, g⟩) in
    one add, q ⊙ · (10)."""
    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    with ChunkPasses(8 * 64) as rec:
        jsd_kernel(beta)(zs, zt)
    assert len(rec.ops) == passes, rec.ops


def test_fused_engine_adds_only_the_four_matmuls_per_chunk() -> None:
    """Per chunk: zs and zt (2 mm), then the kernel, then ∂h and ∂W (mm, addmm_); the mean's factor is folded into
    the [c, H] operands, not a pass over [c, V]."""
    g = torch.Generator().manual_seed(0)
    c, v, h = 8, 64, 16
    hs = torch.randn(c, h, generator=g).requires_grad_(True)
    w = torch.randn(v, h, generator=g).requires_grad_(True)
    zs, zt = torch.randn(c, v, generator=g), torch.randn(c, v, generator=g)
    ht = torch.randn(c, h, generator=g)
    with ChunkPasses(c * v) as kernel_only:
        jsd_kernel(0.5)(zs, zt)
    with ChunkPasses(c * v) as rec:
        fused_linear_generalized_jsd(hs, w, ht, beta=0.5, chunk_size=c)
    assert len(rec.ops) == len(kernel_only.ops) + 4, rec.ops


@pytest.mark.parametrize("form", ["fused", "logits"])
def test_a_direct_call_reads_the_host_once_whatever_the_chunks(form: str) -> None:
    """8 chunks, value checks on (a direct call): one host read for the whole call."""
    g = torch.Generator().manual_seed(0)
    n, v, h = 64, 50, 8
    if form == "fused":
        hs = torch.randn(n, h, generator=g).requires_grad_(True)
        w = torch.randn(v, h, generator=g).requires_grad_(True)
        with RecordOps() as rec:
            fused_linear_generalized_jsd(hs, w, torch.randn(n, h, generator=g), chunk_size=8)
    else:
        zs = torch.randn(n, v, generator=g).requires_grad_(True)
        with RecordOps() as rec:
            generalized_jsd(zs, torch.randn(n, v, generator=g), chunk_size=8)
    reads = [op for op in rec.ops if op in HOST_READS]
    assert len(reads) == 1, reads


@pytest.mark.parametrize("form", ["fused", "logits"])
def test_a_non_finite_chunk_still_raises_naming_its_input(form: str) -> None:
    """The one check per call still catches a NaN in any chunk (here the last) and names the input."""
    g = torch.Generator().manual_seed(0)
    n, v, h = 64, 50, 8
    if form == "fused":
        hs = torch.randn(n, h, generator=g)
        hs[-1, 0] = float("nan")
        with pytest.raises(ValueError, match="student_hidden"):
            fused_linear_generalized_jsd(hs, torch.randn(v, h, generator=g), torch.randn(n, h), chunk_size=8)
    else:
        zt = torch.randn(n, v, generator=g)
        zt[-1, 3] = float("inf")
        with pytest.raises(ValueError, match="`teacher_logits` contains NaN/inf"):
            generalized_jsd(torch.randn(n, v, generator=g), zt, chunk_size=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form", ["fused", "logits"])
def test_cuda_extra_memory_at_the_default_chunk(form: str) -> None:
    """The bench's size (V = 32,768, N = 4,096, H = 896) on the device: the caching allocator's peak above the
    inputs is the larger of the forward's (gradients + 4¼ chunk × V buffers) and the backward's (the gradients
    and their scaled copy), + 32 MiB of allocator rounding."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n, h = 4096, 896
    if form == "fused":
        hs = torch.randn(n, h, device=dev, generator=g).requires_grad_(True)
        w = (torch.randn(V, h, device=dev, generator=g) / h**0.5).requires_grad_(True)
        ht = torch.randn(n, h, device=dev, generator=g)
        run = lambda: fused_linear_generalized_jsd(hs, w, ht, beta=0.5)  # noqa: E731
        params, grads = (hs, w), (n * h + V * h) * 4
    else:
        zs = torch.randn(n, V, device=dev, generator=g).requires_grad_(True)
        zt = torch.randn(n, V, device=dev, generator=g)
        run = lambda: generalized_jsd(zs, zt, beta=0.5)  # noqa: E731
        params, grads = (zs,), n * V * 4
    run().backward()  # warm: cuBLAS workspaces
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    chunk_bytes = chunk_rows(None, V, fused=form == "fused") * V * 4
    assert extra <= max(grads + 4.25 * chunk_bytes, 2 * grads) + 32 * 2**20, f"{extra / 2**20:.0f} MiB"
