"""Host syncs of one ``compose_loss`` forward + backward on an accelerator.

``tests/loss/test_config.py`` counts the host reads Python makes (``Tensor.item/__bool__/...``); it cannot see
the implicit syncs of data-dependent ops (``nonzero``, boolean indexing) or of a read made in C++. The promise
for the hot loop: at most one host sync per call with value checks on (their fused read), none with
``check_values=False``, none in backward.

- On the CPU the accelerator path is forced (``distill.host_reads_are_free`` patched to False: rows are masked,
  not selected; no ``grad_out == 1`` read; the entropy gate is not read) and every aten op of forward and
  backward is recorded: none may read a value to the host, and the result must equal the host path's.
- On a CUDA device ``torch.cuda.set_sync_debug_mode("warn")`` reports every synchronizing call (skipped
  without one).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from composer_core import ComposerBatch, compose_loss, fused_linear_generalized_jsd, generalized_jsd
from composer_core.loss import distill
from composer_core.loss.config import ComposeConfig
from composer_core.loss.wrappers import entropy_opd_loss
from composer_testkit.host_reads import HOST_READS, RecordOps

B, T, V, H, P = 4, 16, 3000, 32, 3
FORMS: dict[str, tuple[str, dict[str, object]]] = {
    "full_logits": ("logits", {"sdpo_chunk_size": 16}),
    "fused_hidden": ("hidden", {"sdpo_chunk_size": 16}),
    # temperature enters the gradient's factor, a device scalar on an accelerator: host and device paths must agree
    "full_logits_t2": ("logits", {"sdpo_chunk_size": 16, "sdpo_temperature": 2.0}),
    "fused_hidden_t2": ("hidden", {"sdpo_chunk_size": 16, "sdpo_temperature": 2.0}),
    "topk": ("logits", {"sdpo_topk": 8}),
    "sampled": ("sampled", {}),
    "taid": ("logits", {"sdpo_wrapper": "taid", "taid_t": 0.7, "sdpo_chunk_size": 16}),
    "taid_fused": ("hidden", {"sdpo_wrapper": "taid", "taid_t": 0.7, "sdpo_chunk_size": 16}),
    "entropy_opd": ("logits", {"sdpo_wrapper": "entropy_opd", "entropy_opd_threshold": 0.1}),
    "entropy_opd_fused": ("hidden", {"sdpo_wrapper": "entropy_opd", "entropy_opd_threshold": 0.1}),
}
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _batch(kind: str, dtype: torch.dtype, device: str) -> ComposerBatch:
    g = torch.Generator().manual_seed(0)
    c = lambda x: x.to(device, dtype) if x.is_floating_point() else x.to(device)  # noqa: E731
    r = lambda *s: c(torch.randn(*s, generator=g))  # noqa: E731
    mask = torch.ones(B, T)
    mask[1, 9:] = 0
    mask[3, 4:] = 0
    b = ComposerBatch(
        logprobs=(r(B, T) - 2).requires_grad_(True),
        advantages=r(B),
        completion_mask=c(mask),
        old_logprobs=r(B, T) - 2,
        ref_logprobs=r(B, T) - 2,
        sdpo_mask=c(mask),
        chosen_logps=(r(P) * 3).requires_grad_(True),
        rejected_logps=(r(P) * 3).requires_grad_(True),
        ref_chosen_logps=r(P) * 3,
        ref_rejected_logps=r(P) * 3,
        chosen_lengths=torch.tensor([3, 4, 9], device=device),
        rejected_lengths=torch.tensor([2, 5, 7], device=device),
    )
    if kind == "logits":
        b.student_logits, b.teacher_logits = (r(B, T, V) * 3).requires_grad_(True), r(B, T, V) * 3
    elif kind == "hidden":
        b.student_hidden, b.teacher_hidden = r(B, T, H).requires_grad_(True), r(B, T, H)
        b.lm_head_weight = (r(V, H) * 0.3).requires_grad_(True)
    else:
        b.teacher_logprobs = r(B, T) - 2
    return b


def _config(form: str) -> ComposeConfig:
    return ComposeConfig.from_flat(alpha_sdpo=0.5, beta_replay=0.3, kl_beta=0.04, **FORMS[form][1])


def _norms(device: str, tensor: bool) -> dict[str, Any]:
    """The trainer's global token counts; a float one is read on the host by design, a tensor one is not."""
    make = (lambda v: torch.tensor(v, device=device)) if tensor else (lambda v: v)
    return {"normalizer": make(40.0), "sdpo_normalizer": make(40.0), "replay_normalizer": make(float(P))}


def _leaves(b: ComposerBatch) -> list[torch.Tensor]:
    fields = (getattr(b, f.name) for f in dataclasses.fields(b))
    return [t for t in fields if isinstance(t, torch.Tensor) and t.requires_grad]


def _value_and_grads(b: ComposerBatch, cfg: ComposeConfig, norms: dict[str, Any]) -> list[torch.Tensor]:
    for t in _leaves(b):
        t.grad = None
    out = compose_loss(b, cfg, **norms)
    out.total.backward()
    return [out.total.detach(), *(t.grad for t in _leaves(b) if t.grad is not None)]


@pytest.fixture
def accelerator_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distill, "host_reads_are_free", lambda device: False)


# ------------------------------------------------------------------ CPU: the accelerator path, op by op
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("normalizers", ["none", "tensor"])
def test_accelerator_path_reads_nothing_to_the_host_and_equals_the_host_path(
    form: str, normalizers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = _batch(FORMS[form][0], torch.float64, "cpu")
    cfg = dataclasses.replace(_config(form), check_values=False)
    norms = _norms("cpu", tensor=True) if normalizers == "tensor" else {}
    want = _value_and_grads(b, cfg, norms)  # the host path: rows selected by index
    monkeypatch.setattr(distill, "host_reads_are_free", lambda device: False)
    for t in _leaves(b):
        t.grad = None
    with RecordOps() as fwd:
        out = compose_loss(b, cfg, **norms)
    with RecordOps() as bwd:
        out.total.backward()
    reads = [op for op in fwd.ops + bwd.ops if op in HOST_READS]
    if normalizers == "none":  # the policy and replay means count their tokens on the host by design
        reads = [op for op in reads if op != "aten._local_scalar_dense.default"]
    assert reads == []
    got = [out.total.detach(), *(t.grad for t in _leaves(b) if t.grad is not None)]
    assert len(got) == len(want)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-15)


@pytest.mark.usefixtures("accelerator_path")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_accelerator_path_masks_rows_nan_safely(reduction: str) -> None:
    """Masked rows are computed on an accelerator: a NaN in one (padding) stays out of value and gradient."""
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(3, 5, 40, generator=g, dtype=torch.float64), torch.randn(3, 5, 40, generator=g)
    t = t.double()
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    s_nan, t_nan = s.clone(), t.clone()
    s_nan[2, 4], t_nan[2, 3] = float("nan"), float("inf")
    for fn in (generalized_jsd, entropy_opd_loss):
        ref = s.detach().clone().requires_grad_(True)
        bad = s_nan.detach().clone().requires_grad_(True)
        want = fn(ref, t, mask=mask, chunk_size=4, reduction=reduction)  # type: ignore[operator]
        got = fn(bad, t_nan, mask=mask, chunk_size=4, reduction=reduction)  # type: ignore[operator]
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0.0)
        assert ref.grad is not None and bad.grad is not None
        torch.testing.assert_close(bad.grad, ref.grad, rtol=1e-12, atol=0.0)
        assert not bad.grad[2, 3:].any()


@pytest.mark.usefixtures("accelerator_path")
def test_accelerator_path_mean_over_one_kept_row_is_that_row() -> None:
    """The mean divides by the mask's count kept on the device: one kept token gives exactly its own loss."""
    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 3, 40, generator=g, dtype=torch.float64)
    t = torch.randn(2, 3, 40, generator=g, dtype=torch.float64)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    mask[1, 2] = True
    rows = generalized_jsd(s, t, chunk_size=4, reduction="none")
    one = generalized_jsd(s, t, mask=mask, chunk_size=4)
    assert one.item() == pytest.approx(rows[1, 2].item(), rel=1e-12)


@pytest.mark.usefixtures("accelerator_path")
def test_accelerator_path_still_names_a_non_finite_kept_row() -> None:
    s, t = torch.randn(2, 6, 30, dtype=torch.float64), torch.randn(2, 6, 30, dtype=torch.float64)
    t[1, 2, 7] = float("nan")
    with pytest.raises(ValueError, match="`teacher_logits` contains NaN/inf"):
        generalized_jsd(s, t, chunk_size=4)
    h, w = torch.randn(12, 8, dtype=torch.float64), torch.randn(30, 8, dtype=torch.float64)
    ht = h.clone()
    ht[5] = 1e308  # finite, but its logits overflow: the chunk check (not the input check) must fire
    with pytest.raises(ValueError, match="overflow to NaN/inf"):
        fused_linear_generalized_jsd(h, w, ht, chunk_size=4)


# ------------------------------------------------------------------ CUDA: counted by CUDA itself
@contextmanager
def _syncs() -> Iterator[list[str]]:
    """Every synchronizing CUDA call in the block, as 'file:line: message'."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        seen: list[str] = []
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seen += [f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)]


@_NO_CUDA
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compose_loss_on_cuda_syncs_at_most_once_and_never_in_backward(form: str, dtype: torch.dtype) -> None:
    b = _batch(FORMS[form][0], dtype, "cuda")
    cfg, norms = _config(form), _norms("cuda", tensor=True)
    want = _value_and_grads(b, cfg, norms)  # also the warm-up: kernels, caches
    report: dict[str, tuple[list[str], list[str]]] = {}
    for name, c in (("checks on", cfg), ("checks off", dataclasses.replace(cfg, check_values=False))):
        for t in _leaves(b):
            t.grad = None
        amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
        with amp, _syncs() as fwd:
            out = compose_loss(b, c, **norms)
        with _syncs() as bwd:
            out.total.backward()
        report[name] = (fwd, bwd)
        got = [out.total.detach(), *(t.grad for t in _leaves(b) if t.grad is not None)]
        assert all(x.device.type == "cuda" for x in got)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=0.0, atol=0.0)  # the same computation either way
    (on_fwd, on_bwd), (off_fwd, off_bwd) = report["checks on"], report["checks off"]
    assert len(on_fwd) <= 1, "\n".join(on_fwd)
    assert off_fwd == [], "\n".join(off_fwd)
    assert on_bwd == off_bwd == [], "\n".join(on_bwd + off_bwd)


@_NO_CUDA
@pytest.mark.parametrize("form", sorted(FORMS))
def test_compose_loss_on_cuda_equals_the_cpu_host_path(form: str) -> None:
    """Masked rows computed and zeroed on CUDA give the CPU's row selection (float64, to rounding)."""
    cfg, kind = _config(form), FORMS[form][0]
    want = _value_and_grads(_batch(kind, torch.float64, "cpu"), cfg, _norms("cpu", tensor=False))
    got = _value_and_grads(_batch(kind, torch.float64, "cuda"), cfg, _norms("cuda", tensor=True))
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), e, rtol=1e-10, atol=1e-13)
