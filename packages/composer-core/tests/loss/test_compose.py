from __future__ import annotations

import dataclasses

import pytest
import torch
from composer_core import (
    DPO,
    ComposerBatch,
    PolicyOptions,
    SimPO,
    dpo_loss,
    entropy_opd_loss,
    fused_linear_generalized_jsd,
    generalized_jsd,
    policy_loss,
    sampled_token_distill,
    simpo_loss,
    taid_loss,
    topk_distill,
)
from composer_core import compose_loss as core_compose_loss

D = torch.float64
B, T, V, H, P = 4, 5, 9, 6, 3
SDPO_INPUTS = (
    "sdpo_mask",
    "student_logits",
    "teacher_logits",
    "student_hidden",
    "teacher_hidden",
    "lm_head_weight",
)
REPLAY_INPUTS = ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps", "chosen_lengths",
                 "rejected_lengths")  # fmt: skip


def compose_loss(batch: ComposerBatch, config: object = None, /, **options: object):  # type: ignore[no-untyped-def]
    """core's ``compose_loss`` with channels 2 and 3 on (weight 1) unless the test sets their weights: core's
    defaults are 0, and these batches carry every channel's inputs."""
    if config is None:
        options = {"alpha_sdpo": 1.0, "beta_replay": 1.0, **options}
    return core_compose_loss(batch, config, **options)  # type: ignore[arg-type]


def _without(b: ComposerBatch, *names: str) -> ComposerBatch:
    return dataclasses.replace(b, **dict.fromkeys(names))


def _batch(
    seed: int = 0, *, hidden: bool = False, sampled: bool = False, logits: bool = True
) -> ComposerBatch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    sdpo_mask = mask.clone()
    sdpo_mask[0] = 0  # sample 0 had no hint
    r = lambda *s: torch.randn(*s, generator=g, dtype=D)  # noqa: E731
    b = ComposerBatch(
        logprobs=(r(B, T) - 2).requires_grad_(True),
        advantages=r(B),
        completion_mask=mask,
        sdpo_mask=sdpo_mask,
        chosen_logps=(r(P) * 3).requires_grad_(True),
        rejected_logps=(r(P) * 3).requires_grad_(True),
        ref_chosen_logps=r(P) * 3,
        ref_rejected_logps=r(P) * 3,
        chosen_lengths=torch.tensor([3, 4, 5]),
        rejected_lengths=torch.tensor([2, 6, 1]),
    )
    if logits:
        b.student_logits = r(B, T, V).requires_grad_(True)
        b.teacher_logits = r(B, T, V)
    if hidden:
        b.student_hidden = r(B, T, H).requires_grad_(True)
        b.teacher_hidden = r(B, T, H)
        b.lm_head_weight = r(V, H).requires_grad_(True)
    if sampled:
        b.teacher_logprobs = r(B, T) - 2
    return b


def _grads(loss: torch.Tensor, b: ComposerBatch) -> list[torch.Tensor]:
    leaves = [t for t in (b.logprobs, b.student_logits, b.chosen_logps, b.rejected_logps) if t is not None]
    return [
        g if g is not None else torch.zeros(()) for g in torch.autograd.grad(loss, leaves, allow_unused=True)
    ]


# ------------------------------------------------------------------ invariants
@pytest.mark.parametrize(("alpha", "beta"), [(0.0, 0.0), (0.0, 1.0), (1.0, 0.0)])
def test_zero_weight_channels_refuse_their_inputs_and_are_not_computed(alpha: float, beta: float) -> None:
    b = _batch()
    off = "alpha_sdpo" if alpha == 0 else "beta_replay"
    first = "sdpo_mask" if alpha == 0 else "chosen_logps"
    with pytest.raises(
        ValueError, match=rf"^`{first}`.* passed with {off}=0 .*: set {off} > 0 to train on them, "
    ):
        core_compose_loss(b, alpha_sdpo=alpha, beta_replay=beta)
    # without the off channel's inputs, the channel is not computed: the total is the remaining channels', bit
    # for bit the same as with the channel's weight at 1 and its inputs absent (skipped)
    b = _without(b, *(SDPO_INPUTS if alpha == 0 else ()), *(REPLAY_INPUTS if beta == 0 else ()))
    r = compose_loss(b, alpha_sdpo=alpha, beta_replay=beta, kl_beta=0.0)
    ref = compose_loss(b, kl_beta=0.0)
    assert torch.equal(r.total, ref.total)
    grads = _grads(r.total, b)
    for g1, g2 in zip(grads, _grads(ref.total, b)):
        assert torch.equal(g1, g2)
    if alpha == 0 and beta == 0:
        p = policy_loss(b.logprobs, b.advantages, b.completion_mask)
        assert torch.equal(r.total, p.loss)
        assert torch.equal(grads[0], torch.autograd.grad(p.loss, b.logprobs)[0])
    assert (r.sdpo is None) == (alpha == 0) and (r.replay is None) == (beta == 0)
    assert r.metrics["sdpo/skipped"] == float(alpha == 0) and r.metrics["replay/skipped"] == float(beta == 0)


def test_absent_channels_are_skipped_and_reported() -> None:
    b = _batch(logits=False)
    b.chosen_logps = b.rejected_logps = None
    r = compose_loss(b)
    assert r.sdpo is None and r.replay is None
    assert r.metrics["sdpo/skipped"] == 1.0 and r.metrics["replay/skipped"] == 1.0
    assert "loss/sdpo" not in r.metrics and "loss/replay" not in r.metrics
    assert torch.equal(r.total, policy_loss(b.logprobs, b.advantages, b.completion_mask).loss)


def test_total_metrics_and_own_normalisers() -> None:
    b = _batch()
    r = compose_loss(b, alpha_sdpo=0.3, beta_replay=2.0, kl_beta=0.0)
    assert r.sdpo is not None and r.replay is not None
    torch.testing.assert_close(r.total, r.policy + 0.3 * r.sdpo + 2.0 * r.replay)
    # channel 2 is normalised by its own token count (sdpo_mask), channel 3 by the pair count
    assert b.sdpo_mask is not None and b.student_logits is not None and b.teacher_logits is not None
    n_sdpo = int(b.sdpo_mask.sum())
    assert n_sdpo != int(b.completion_mask.sum())
    jsd_sum = generalized_jsd(b.student_logits, b.teacher_logits, mask=b.sdpo_mask, reduction="sum")
    assert r.sdpo.item() == pytest.approx(jsd_sum.item() / n_sdpo, rel=1e-12)
    assert b.ref_chosen_logps is not None and b.ref_rejected_logps is not None
    pairs = dpo_loss(
        b.chosen_logps, b.rejected_logps, b.ref_chosen_logps, b.ref_rejected_logps, reduction="sum"
    )  # type: ignore[arg-type]
    assert r.replay.item() == pytest.approx(pairs.item() / P, rel=1e-12)
    expected_keys = {
        "loss/total",
        "loss/policy",
        "loss/sdpo",
        "loss/replay",
        "sdpo/skipped",
        "replay/skipped",
        "policy/clip_ratio",
        "sdpo/tokens",
        "replay/pairs",
        "replay/accuracy",
    }
    assert expected_keys <= set(r.metrics)
    assert r.metrics["sdpo/tokens"] == n_sdpo and r.metrics["replay/pairs"] == P
    assert r.metrics["loss/total"] == pytest.approx(r.total.item())
    h = (b.chosen_logps - b.ref_chosen_logps) - (b.rejected_logps - b.ref_rejected_logps)  # type: ignore[operator]
    assert r.metrics["replay/accuracy"] == pytest.approx(float((h > 0).double().mean()))


def test_sdpo_mask_defaults_to_completion_mask() -> None:
    b = dataclasses.replace(_batch(), sdpo_mask=None)
    r = compose_loss(b)
    assert b.student_logits is not None and b.teacher_logits is not None and r.sdpo is not None
    ref = generalized_jsd(b.student_logits, b.teacher_logits, mask=b.completion_mask)
    assert torch.equal(r.sdpo, ref)


def test_global_normalisers_make_accumulation_exact_for_all_channels() -> None:
    b = _batch(3)
    kw = dict(alpha_sdpo=0.7, beta_replay=0.4)
    full = compose_loss(b, **kw)  # type: ignore[arg-type]
    g_full = _grads(full.total, b)
    assert b.sdpo_mask is not None
    norms = dict(
        normalizer=float(b.completion_mask.sum()),
        sdpo_normalizer=float(b.sdpo_mask.sum()),
        replay_normalizer=float(P),
    )
    acc = [torch.zeros_like(g) for g in g_full]
    total = 0.0
    for rows, pairs in (([0, 1], [0]), ([2, 3], [1, 2])):
        part = ComposerBatch(
            logprobs=b.logprobs[rows],
            advantages=b.advantages[rows],
            completion_mask=b.completion_mask[rows],
            sdpo_mask=b.sdpo_mask[rows],
            student_logits=b.student_logits[rows],  # type: ignore[index]
            teacher_logits=b.teacher_logits[rows],  # type: ignore[index]
            chosen_logps=b.chosen_logps[pairs],  # type: ignore[index]
            rejected_logps=b.rejected_logps[pairs],  # type: ignore[index]
            ref_chosen_logps=b.ref_chosen_logps[pairs],  # type: ignore[index]
            ref_rejected_logps=b.ref_rejected_logps[pairs],  # type: ignore[index]
        )
        out = compose_loss(part, **kw, **norms)  # type: ignore[arg-type]
        total += out.total.item()
        for a, g in zip(acc, _grads(out.total, b)):
            a += g
    assert total == pytest.approx(full.total.item(), rel=1e-12)
    for a, g in zip(acc, g_full):
        torch.testing.assert_close(a, g, rtol=1e-12, atol=1e-14)


def test_gradcheck_compose_total() -> None:
    b = _batch(4)
    # explicit old log-probs: with old=None the ratio is exp(ℓ − sg(ℓ)) ≡ 1, whose value is flat by design
    b.old_logprobs = b.logprobs.detach() - 0.1
    assert b.student_logits is not None
    s0, c0, r0 = b.student_logits, b.chosen_logps, b.rejected_logps

    def f(lp: torch.Tensor, s: torch.Tensor, c: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        bb = dataclasses.replace(b, logprobs=lp, student_logits=s, chosen_logps=c, rejected_logps=r)
        # the SDPO IS clip's weight is a stop-gradient function of ℓ (test_is_clip.py checks it with ℓ fixed)
        return compose_loss(
            bb, alpha_sdpo=0.5, beta_replay=0.5, kl_beta=0.0, sdpo_chunk_size=3, sdpo_token_clip=None
        ).total

    assert torch.autograd.gradcheck(f, (b.logprobs, s0, c0, r0), fast_mode=True)


# ------------------------------------------------------------------ forms, wrappers, variants
def test_sdpo_forms_match_the_standalone_losses() -> None:
    b = _batch(5, hidden=True, sampled=True)
    m = b.sdpo_mask
    assert b.student_logits is not None and b.teacher_logits is not None and b.teacher_logprobs is not None
    assert b.student_hidden is not None and b.teacher_hidden is not None and b.lm_head_weight is not None
    auto = compose_loss(b, sdpo_beta=0.2, sdpo_temperature=0.8).sdpo
    assert torch.equal(
        auto, generalized_jsd(b.student_logits, b.teacher_logits, beta=0.2, temperature=0.8, mask=m)
    )  # type: ignore[arg-type]
    topk = compose_loss(b, sdpo_topk=3).sdpo
    assert torch.equal(topk, topk_distill(b.student_logits, b.teacher_logits, k=3, mask=m))  # type: ignore[arg-type]
    sampled = compose_loss(b, sdpo_form="sampled", sdpo_token_clip=None).sdpo
    assert torch.equal(sampled, sampled_token_distill(b.logprobs, b.teacher_logprobs, m, is_clip=None))  # type: ignore[arg-type]
    fused_b = dataclasses.replace(b, student_logits=None, teacher_logits=None)
    fused = compose_loss(fused_b, sdpo_chunk_size=4).sdpo
    ref = fused_linear_generalized_jsd(
        b.student_hidden, b.lm_head_weight, b.teacher_hidden, mask=m, chunk_size=4
    )
    assert torch.equal(fused, ref)  # type: ignore[arg-type]
    only_sampled = dataclasses.replace(fused_b, student_hidden=None, teacher_hidden=None, lm_head_weight=None)
    old = b.logprobs.detach() - 0.5
    clip = compose_loss(dataclasses.replace(only_sampled, old_logprobs=old), sdpo_token_clip=1.2).sdpo
    ref_clip = sampled_token_distill(b.logprobs, b.teacher_logprobs, m, old_logprobs=old, is_clip=1.2)  # type: ignore[arg-type]
    assert torch.equal(clip, ref_clip)  # type: ignore[arg-type]


def test_wrappers_through_compose() -> None:
    b = _batch(6)
    assert b.student_logits is not None and b.teacher_logits is not None
    m = b.sdpo_mask
    r = compose_loss(b, sdpo_wrapper="taid", taid_t=0.35)
    assert torch.equal(r.sdpo, taid_loss(b.student_logits, b.teacher_logits, 0.35, mask=m))  # type: ignore[arg-type]
    assert r.metrics["taid/t"] == 0.35
    r = compose_loss(
        b, sdpo_wrapper="taid", taid_schedule_step=5, taid_total_steps=10, taid_t_start=0.2, taid_t_end=0.6
    )
    assert r.metrics["taid/t"] == pytest.approx(0.4)
    r = compose_loss(
        b,
        sdpo_wrapper="entropy_opd",
        entropy_opd_threshold=0.1,
        entropy_opd_weight=0.5,
        sdpo_beta=1.0,
        sdpo_topk=4,
    )
    ref = entropy_opd_loss(
        b.student_logits, b.teacher_logits, threshold=0.1, fkl_weight=0.5, beta=1.0, topk=4, mask=m
    )
    assert torch.equal(r.sdpo, ref)  # type: ignore[arg-type]
    # fused form with a wrapper equals the logits form on the same logits
    hb = _batch(7, hidden=True, logits=False)
    assert hb.student_hidden is not None and hb.lm_head_weight is not None and hb.teacher_hidden is not None
    fused = compose_loss(hb, sdpo_wrapper="taid", taid_t=0.5).sdpo
    logits = compose_loss(
        dataclasses.replace(
            hb,
            student_logits=hb.student_hidden @ hb.lm_head_weight.T,
            teacher_logits=hb.teacher_hidden @ hb.lm_head_weight.T,
        ),
        sdpo_wrapper="taid",
        taid_t=0.5,
    ).sdpo
    torch.testing.assert_close(fused, logits)


def test_replay_variants_through_compose() -> None:
    b = _batch(8)
    args = (b.chosen_logps, b.rejected_logps)
    r = compose_loss(b, dpo_variant="simpo", simpo_beta=1.5, simpo_gamma=0.3)
    assert torch.equal(
        r.replay, simpo_loss(*args, b.chosen_lengths, b.rejected_lengths, options=SimPO(beta=1.5, gamma=0.3))
    )  # type: ignore[arg-type]
    # SimPO's accuracy counts its length-normalised margin c/|c| − r/|r| > 0: 2 of these 3 pairs (the raw
    # difference c − r is positive for all 3, the sum c/|c| + r/|r| for none)
    t = lambda *v: torch.tensor(v, dtype=b.chosen_logps.dtype)  # noqa: E731
    pairs = dataclasses.replace(
        b,
        chosen_logps=t(-2.0, -1.0, -2.0),
        rejected_logps=t(-6.0, -3.0, -4.0),
        chosen_lengths=torch.tensor([1, 1, 2]),
        rejected_lengths=torch.tensor([6, 1, 2]),
    )
    assert compose_loss(pairs, dpo_variant="simpo").metrics["replay/accuracy"] == pytest.approx(2 / 3)
    refs = (b.ref_chosen_logps, b.ref_rejected_logps)
    r = compose_loss(b, dpo_beta=0.2, dpo_loss_type="robust", dpo_label_smoothing=0.1)
    assert torch.equal(
        r.replay, dpo_loss(*args, *refs, options=DPO(beta=0.2, loss_type="robust", label_smoothing=0.1))
    )  # type: ignore[arg-type]
    r = compose_loss(b, dpo_loss_type="ipo")
    ipo = dpo_loss(
        *args,
        *refs,
        options=DPO(loss_type="ipo"),
        chosen_lengths=b.chosen_lengths,
        rejected_lengths=b.rejected_lengths,
    )  # type: ignore[arg-type]
    assert torch.equal(r.replay, ipo)  # type: ignore[arg-type]


def test_policy_options_pass_through() -> None:
    b = _batch(9)
    b.ref_logprobs = b.logprobs.detach() + 0.1
    kw = dict(loss_type="grpo", epsilon_low=0.1, epsilon_high=0.3, kl_beta=0.05, kl_estimator="k2")
    r = compose_loss(_without(b, *SDPO_INPUTS, *REPLAY_INPUTS), alpha_sdpo=0, beta_replay=0, **kw)
    p = policy_loss(
        b.logprobs, b.advantages, b.completion_mask, ref_logprobs=b.ref_logprobs, options=PolicyOptions(**kw)
    )  # type: ignore[arg-type]
    assert torch.equal(r.total, p.loss)
    assert r.metrics["policy/kl"] == p.metrics["policy/kl"]


# ------------------------------------------------------------------ bad input
def test_compose_bad_inputs() -> None:
    b = _batch(10, hidden=True, sampled=True)
    no_logits = dataclasses.replace(b, student_logits=None, teacher_logits=None)
    cases: list[tuple[object, str]] = [
        (lambda: compose_loss(b, alpha_sdp=0.5), r"alpha_sdp.*did you mean 'alpha_sdpo'"),
        (lambda: compose_loss(b, alpha_sdpo=-1.0), r"alpha_sdpo"),
        (lambda: compose_loss(b, sdpo_wrapper="taid"), r"taid_t"),
        (
            lambda: compose_loss(
                b, sdpo_wrapper="taid", taid_t=0.5, taid_schedule_step=1, taid_total_steps=4
            ),
            r"not both",
        ),
        (lambda: compose_loss(b, sdpo_wrapper="taid", taid_schedule_step=1), r"taid_total_steps"),
        (lambda: compose_loss(b, sdpo_wrapper="taid", taid_t=1.5), r"taid_t"),
        (lambda: compose_loss(b, sdpo_wrapper="entropy_opd", sdpo_form="sampled"), r"full-vocabulary"),
        (lambda: compose_loss(b, sdpo_wrapper="taid", sdpo_form="topk", taid_t=0.5), r"full-vocabulary"),
        (lambda: compose_loss(b, sdpo_form="topk"), r"sdpo_topk"),
        # options of a wrapper / form that is not selected would be silently ignored
        (lambda: compose_loss(b, taid_t=0.5), r"taid_t.*sdpo_wrapper='taid'"),
        (
            lambda: compose_loss(b, sdpo_wrapper="entropy_opd", taid_schedule_step=1, taid_total_steps=4),
            r"taid_schedule_step.*taid_total_steps.*only apply",
        ),
        (lambda: compose_loss(b, sdpo_form="sampled", sdpo_topk=2), r"sdpo_topk.*'sampled'"),
        (lambda: compose_loss(no_logits, sdpo_topk=2), r"sdpo_topk.*'full'"),
        (lambda: compose_loss(b, sdpo_wrapper="taid", taid_t=0.5, sdpo_topk=2), r"sdpo_topk.*taid"),
        (lambda: compose_loss(b, sdpo_wrapper="cosine"), r"sdpo_wrapper"),  # type: ignore[arg-type]
        (lambda: compose_loss(b, sdpo_form="fused"), r"sdpo_form"),  # type: ignore[arg-type]
        (lambda: compose_loss(b, dpo_variant="kto"), r"dpo_variant"),  # type: ignore[arg-type]
        (lambda: compose_loss(b, sdpo_beta=2.0), r"sdpo_beta"),
        (lambda: compose_loss(dataclasses.replace(b, teacher_logits=None)), r"teacher_logits"),
        (
            lambda: compose_loss(dataclasses.replace(no_logits, lm_head_weight=None, teacher_logprobs=None)),
            r"lm_head_weight",
        ),
        (
            lambda: compose_loss(dataclasses.replace(b, teacher_logits=b.teacher_logits[..., :5])),
            r"teacher_logits.*shape",
        ),  # type: ignore[index]
        (
            lambda: compose_loss(
                dataclasses.replace(
                    b, student_logits=b.student_logits[:, :3], teacher_logits=b.teacher_logits[:, :3]
                )
            ),
            r"student_logits.*\[B, T\]",
        ),  # type: ignore[index]
        (
            lambda: compose_loss(dataclasses.replace(b, sdpo_mask=torch.zeros(B, T))),
            r"sdpo_mask.*selects no token",
        ),
        (lambda: compose_loss(dataclasses.replace(b, rejected_logps=None)), r"rejected_logps"),
        (lambda: compose_loss(dataclasses.replace(b, ref_chosen_logps=None)), r"ref_chosen_logps.*simpo"),
        (
            lambda: compose_loss(dataclasses.replace(b, chosen_lengths=None), dpo_variant="simpo"),
            r"chosen_lengths",
        ),
        (
            lambda: compose_loss(dataclasses.replace(b, teacher_logits=b.teacher_logits * float("nan"))),
            r"teacher_logits.*NaN",
        ),  # type: ignore[operator]
        (
            lambda: compose_loss(dataclasses.replace(b, chosen_logps=b.chosen_logps * float("inf"))),
            r"chosen_logps.*NaN/inf",
        ),  # type: ignore[operator]
        (lambda: compose_loss(b, sdpo_form="sampled", sdpo_token_clip=-1.0), r"is_clip"),
        (
            lambda: compose_loss(dataclasses.replace(no_logits, teacher_logprobs=None), sdpo_form="sampled"),
            r"teacher_logprobs",
        ),
        (lambda: compose_loss(b, sdpo_normalizer=-2), r"normalizer"),
        (lambda: compose_loss(b, sdpo_chunk_size=0), r"chunk_size"),
        (lambda: compose_loss(no_logits, sdpo_chunk_size=0), r"chunk_size"),
        (lambda: compose_loss(b, sdpo_temperature=0.0), r"temperature"),
    ]
    for fn, match in cases:
        assert callable(fn)
        with pytest.raises(ValueError, match=match):
            fn()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_all_masked_policy_is_zero_with_zero_gradient_like_trl(loss_type: str) -> None:
    """An all-masked micro-batch (every completion truncated under TRL's mask_truncated_completions) is a loss of
    exactly 0 with zero gradients, as TRL trains it; an empty SDPO mask is a zero contribution only under a global
    normaliser (the distilled tokens are elsewhere), and still an error without one."""
    b = _batch(5)
    b = dataclasses.replace(b, completion_mask=torch.zeros(B, T), sdpo_mask=torch.zeros(B, T))
    b = _without(b, *REPLAY_INPUTS)
    out = compose_loss(b, alpha_sdpo=1.0, beta_replay=0.0, loss_type=loss_type, sdpo_normalizer=7.0)
    assert out.policy.item() == 0.0 and out.sdpo is not None and out.sdpo.item() == 0.0
    out.total.backward()
    for name in ("logprobs", "student_logits"):
        grad = getattr(b, name).grad
        assert grad is None or not grad.any(), name
    with pytest.raises(ValueError, match=r"sdpo_mask.*selects no token"):
        compose_loss(b, alpha_sdpo=1.0, beta_replay=0.0, loss_type=loss_type)


def test_remaining_policy_options_pass_through() -> None:
    b = _batch(11)
    b.old_logprobs = b.logprobs.detach() - 0.6
    inf = b.logprobs.detach() + 0.3
    for kw in (
        {"delta": 1.5, "loss_type": "bnpo"},
        {"rollout_correction": "sequence_mask", "rollout_clip_max": 1.4, "rollout_clip_min": 0.1},
        {"rollout_correction": "dppo_mask", "dppo_mask_low": 0.05, "dppo_mask_high": 0.05},
        {"loss_type": "dr_grpo", "max_completion_length": 12},
    ):
        bb = dataclasses.replace(b, inference_logprobs=inf if "rollout_correction" in kw else None)
        r = compose_loss(_without(bb, *SDPO_INPUTS, *REPLAY_INPUTS), alpha_sdpo=0, beta_replay=0, **kw)
        p = policy_loss(
            bb.logprobs,
            bb.advantages,
            bb.completion_mask,
            old_logprobs=bb.old_logprobs,
            inference_logprobs=bb.inference_logprobs,
            options=PolicyOptions(**kw),  # type: ignore[arg-type]
        )
        assert torch.equal(r.total, p.loss), kw
        plain = policy_loss(bb.logprobs, bb.advantages, bb.completion_mask, old_logprobs=bb.old_logprobs)
        assert r.total.item() != pytest.approx(plain.loss.item(), abs=1e-9), kw


# ------------------------------------------------------------------ mode-specific options are never silently ignored
@pytest.mark.parametrize(
    ("option", "value", "selector"),
    [
        ("dpo_beta", 0.3, {"dpo_variant": "simpo"}),
        ("dpo_loss_type", "ipo", {"dpo_variant": "simpo"}),
        ("dpo_label_smoothing", 0.1, {"dpo_variant": "simpo"}),
        ("simpo_beta", 3.0, {}),
        ("simpo_gamma", 0.1, {}),
        ("taid_t_start", 0.2, {}),
        ("taid_t_end", 0.9, {}),
        ("entropy_opd_threshold", 0.5, {"sdpo_wrapper": "taid", "taid_t": 0.5}),
        ("entropy_opd_weight", 2.0, {}),
        ("sdpo_temperature", 2.0, {"sdpo_form": "sampled"}),
        ("sdpo_beta", 0.3, {"sdpo_form": "sampled"}),
    ],
)
def test_option_of_an_unselected_mode_raises_naming_it(option: str, value: object, selector: dict) -> None:
    from composer_core import ComposeConfig

    with pytest.raises(ValueError, match=f"`{option}`"):
        ComposeConfig.from_flat(**selector, **{option: value})
    with pytest.raises(ValueError, match=f"`{option}`"):
        compose_loss(_mode_batch(), **selector, **{option: value})


def test_mode_options_pass_when_their_mode_is_selected_or_left_at_default() -> None:
    from composer_core import ComposeConfig

    ComposeConfig.from_flat(dpo_variant="simpo", simpo_beta=3.0, simpo_gamma=0.1)
    ComposeConfig.from_flat(dpo_variant="dpo", dpo_beta=0.3, dpo_loss_type="ipo", simpo_beta=2.0)
    ComposeConfig.from_flat(sdpo_wrapper="taid", taid_t_start=0.2, taid_t_end=0.9)
    ComposeConfig.from_flat(sdpo_wrapper="entropy_opd", entropy_opd_threshold=0.5, entropy_opd_weight=2.0)
    ComposeConfig.from_flat(sdpo_form="sampled", sdpo_token_clip=5.0, sdpo_beta=1.0)
    ComposeConfig.from_flat(sdpo_form="auto", sdpo_token_clip=None)
    compose_loss(_mode_batch(), dpo_variant="dpo", dpo_beta=0.3)


def _mode_batch() -> ComposerBatch:
    lp = -torch.rand(2, 3, dtype=torch.float64)
    return ComposerBatch(
        logprobs=lp.requires_grad_(True),
        advantages=torch.tensor([1.0, -1.0], dtype=torch.float64),
        completion_mask=torch.ones(2, 3, dtype=torch.bool),
    )


def test_sdpo_topk_tail_threads_to_topk_distill_and_is_refused_elsewhere() -> None:
    b = _batch()
    m = b.sdpo_mask.bool()  # type: ignore[union-attr]
    off = compose_loss(b, sdpo_topk=3, sdpo_topk_tail=False).sdpo
    ref = topk_distill(b.student_logits, b.teacher_logits, k=3, mask=m, add_tail_bucket=False)  # type: ignore[arg-type]
    assert off is not None and torch.equal(off, ref)
    on = compose_loss(b, sdpo_topk=3).sdpo
    assert on is not None and abs(on.item() - off.item()) > 1e-6  # the default keeps the tail bucket
    with pytest.raises(ValueError, match="sdpo_topk_tail"):
        compose_loss(b, sdpo_form="full", sdpo_topk_tail=False)
    with pytest.raises(ValueError, match="sdpo_topk_tail"):
        compose_loss(b, sdpo_topk_tail=False)  # auto without sdpo_topk: the full form
    # a CLI string is coerced as the typed config coerces every option; anything else names the option
    again = compose_loss(b, sdpo_topk=3, sdpo_topk_tail="false").sdpo  # type: ignore[arg-type]
    assert again is not None and torch.equal(again, off)
    with pytest.raises(ValueError, match="sdpo_topk_tail"):
        compose_loss(b, sdpo_topk=3, sdpo_topk_tail="maybe")  # type: ignore[arg-type]


# ------------------------------------------------------------------ channel 2: kernel x runner
@pytest.mark.parametrize(
    ("form", "options", "fields", "kernel", "runner"),
    [
        ("sampled", {}, {"logits": False, "sampled": True}, "sampled", "_run_sampled"),
        ("topk", {"sdpo_topk": 3}, {}, "topk", "_run_logits"),
        ("full", {}, {}, "jsd", "_run_logits"),
        ("full", {"sdpo_wrapper": "taid", "taid_t": 0.3}, {}, "taid", "_run_logits"),
        (
            "full",
            {"sdpo_wrapper": "entropy_opd"},
            {"logits": False, "hidden": True},
            "entropy_opd",
            "_run_fused",
        ),
        ("full", {}, {"logits": False, "hidden": True}, "jsd", "_run_fused"),
    ],
)
def test_sdpo_is_two_decisions_kernel_then_runner(form, options, fields, kernel, runner) -> None:
    from composer_core.loss.channels import _pick_kernel, _pick_runner
    from composer_core.loss.config import ComposeConfig

    b = _batch(**fields)
    cfg = ComposeConfig.from_flat(sdpo_form=form, **options)
    picked = _pick_kernel(cfg.sdpo, form)
    assert picked.name == kernel and (picked.t == 0.3) == (kernel == "taid")
    assert _pick_runner(b, form).__name__ == runner
