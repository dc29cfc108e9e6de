"""Fused generalized JSD from a teacher whose hidden size differs from the student's (issue 50).

Student ``[N, Hs] @ [V, Hs]ᵀ``, teacher ``[N, Ht] @ [V, Ht]ᵀ``: only the vocabulary must match. The reference is
the unfused form: both logits materialised, then :func:`generalized_jsd` on them, all in float64.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from composer_core import ComposerBatch, compose_loss, fused_linear_generalized_jsd, generalized_jsd

D = torch.float64
B, T, V, HS, HT = 3, 4, 11, 16, 24


def _r(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def _case(seed: int = 0) -> dict[str, torch.Tensor]:
    mask = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) > 0.35
    mask[0, 0] = True
    return {
        "h": _r(B, T, HS, seed=seed + 1).requires_grad_(True),
        "w": (_r(V, HS, seed=seed + 2) / 2).requires_grad_(True),
        "b": _r(V, seed=seed + 3).requires_grad_(True),
        "ht": _r(B, T, HT, seed=seed + 4),
        "wt": _r(V, HT, seed=seed + 5) / 2,
        "bt": _r(V, seed=seed + 6),
        "mask": mask,
    }


@pytest.mark.parametrize("accelerator_path", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, None])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_teacher_of_another_hidden_size_equals_the_unfused_reference(
    beta: float, chunk_size: int | None, accelerator_path: bool, force_accelerator: Callable[[], None]
) -> None:
    if accelerator_path:  # rows as a bool mask in contiguous slices, as on a GPU
        force_accelerator()
    c = _case()
    h, w, b, ht, wt, bt, mask = (c[k] for k in ("h", "w", "b", "ht", "wt", "bt", "mask"))
    out = fused_linear_generalized_jsd(
        h,
        w,
        ht,
        teacher_lm_head_weight=wt,
        lm_head_bias=b,
        teacher_lm_head_bias=bt,
        beta=beta,
        temperature=1.3,
        mask=mask,
        chunk_size=chunk_size,
    )
    ref = generalized_jsd(h @ w.T + b, (ht @ wt.T + bt).detach(), beta=beta, temperature=1.3, mask=mask)
    assert out.dtype == D
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    grads = torch.autograd.grad(out, (h, w, b))
    grads_ref = torch.autograd.grad(ref, (h, w, b))
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_gradcheck_with_a_teacher_of_another_hidden_size() -> None:
    c = _case(7)
    ht, wt, bt, mask = c["ht"], c["wt"], c["bt"], c["mask"]
    assert torch.autograd.gradcheck(
        lambda h_, w_, b_: fused_linear_generalized_jsd(
            h_,
            w_,
            ht,
            teacher_lm_head_weight=wt,
            lm_head_bias=b_,
            teacher_lm_head_bias=bt,
            mask=mask,
            chunk_size=2,
        ),
        (c["h"], c["w"], c["b"]),
    )


def test_the_shape_checks_name_the_arguments() -> None:
    c = _case()
    h, w, ht, wt = c["h"].detach(), c["w"].detach(), c["ht"], c["wt"]
    with pytest.raises(
        ValueError, match=r"teacher_lm_head_weight.*lm_head_weight|lm_head_weight.*teacher_lm_head_weight"
    ):
        fused_linear_generalized_jsd(h, w, ht, teacher_lm_head_weight=wt[: V - 1])
    with pytest.raises(ValueError, match=r"teacher_hidden.*teacher_lm_head_weight"):
        fused_linear_generalized_jsd(h, w, ht[..., : HT - 1], teacher_lm_head_weight=wt)
    with pytest.raises(
        ValueError, match=r"teacher_hidden"
    ):  # the default teacher head is the student's [V, Hs]
        fused_linear_generalized_jsd(h, w, ht)
    with pytest.raises(ValueError, match=r"teacher_hidden.*student_hidden|student_hidden.*teacher_hidden"):
        fused_linear_generalized_jsd(h, w, ht[:, : T - 1], teacher_lm_head_weight=wt)
    with pytest.raises(ValueError, match=r"teacher_lm_head_bias"):
        fused_linear_generalized_jsd(h, w, ht, teacher_lm_head_weight=wt, teacher_lm_head_bias=c["bt"][:-1])


def test_compose_loss_full_form_with_a_teacher_of_another_hidden_size() -> None:
    c = _case(3)
    g = torch.Generator().manual_seed(30)
    batch = ComposerBatch(
        logprobs=(torch.randn(B, T, generator=g, dtype=D) - 2).requires_grad_(True),
        advantages=torch.randn(B, generator=g, dtype=D),
        completion_mask=torch.ones(B, T),
        sdpo_mask=c["mask"],
        student_hidden=c["h"],
        teacher_hidden=c["ht"],
        lm_head_weight=c["w"],
        lm_head_bias=c["b"],
        teacher_lm_head_weight=c["wt"],
        teacher_lm_head_bias=c["bt"],
    )
    r = compose_loss(
        batch, sdpo_form="full", alpha_sdpo=1.0, beta_replay=0.0, sdpo_beta=0.3, sdpo_chunk_size=2
    )
    ref = generalized_jsd(
        c["h"] @ c["w"].T + c["b"], (c["ht"] @ c["wt"].T + c["bt"]).detach(), beta=0.3, mask=c["mask"]
    )
    assert r.sdpo is not None
    torch.testing.assert_close(r.sdpo, ref, rtol=0, atol=1e-10)
    got = torch.autograd.grad(r.sdpo, (c["h"], c["w"]), retain_graph=True)
    want = torch.autograd.grad(ref, (c["h"], c["w"]))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-10)
    (g_total,) = torch.autograd.grad(r.total, c["w"])  # the whole objective reaches the student head
    assert bool(torch.isfinite(g_total).all()) and bool(g_total.abs().sum() > 0)
    # a batch without a separate teacher head still needs the student's hidden size
    with pytest.raises(ValueError, match="teacher_hidden"):
        compose_loss(dataclasses.replace(batch, teacher_lm_head_weight=None, teacher_lm_head_bias=None))
