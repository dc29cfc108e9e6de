"""The policy weight ``w_policy`` and SDPO's importance-sampling clip on every form (issue 60).

- ``total = w_policy·policy + α·sdpo + β·replay``; ``w_policy = 0`` never calls ``policy_loss``; all weights 0
  and a KL coefficient without a policy term are refused.
- The IS clip ``w = min(exp(clamp(ℓθ − ℓold, ±20)), clip)`` (TRL SDPOTrainer's ``distillation_is_clip``) multiplies
  the per-token loss of the full (logits and fused), top-k (tail on/off) and sampled forms: checked against the
  per-token losses times ``w`` (and against TRL's own ``loss_utils`` where trl is installed), and by float64
  gradcheck of the clipped full forms.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from composer_core import ComposerBatch, generalized_jsd, topk_distill
from composer_core import compose_loss as core_compose_loss
from composer_core.loss import compose as compose_module
from composer_core.loss.config import ComposeConfig
from composer_core.loss.distill import is_clip_weight


def compose_loss(batch: ComposerBatch, config: object = None, /, **options: object):  # type: ignore[no-untyped-def]
    """core's ``compose_loss`` with channels 2 and 3 on (weight 1) unless the test sets their weights (core's
    defaults are 0)."""
    if config is None:
        options = {"alpha_sdpo": 1.0, "beta_replay": 1.0, **options}
    return core_compose_loss(batch, config, **options)  # type: ignore[arg-type]


D = torch.float64
B, T, V, H = 3, 4, 7, 5


def _batch(seed: int = 0, *, pairs: bool = False) -> ComposerBatch:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=D)  # noqa: E731
    mask = torch.ones(B, T)
    mask[1, 2:] = 0
    logprobs = (r(B, T) - 1.5).requires_grad_(True)
    b = ComposerBatch(
        logprobs=logprobs,
        advantages=r(B),
        completion_mask=mask,
        # ratios from e^-1.5 to e^1.5: some tokens under the clip 1.3, some above it
        old_logprobs=logprobs.detach() + torch.linspace(-1.5, 1.5, B * T, dtype=D).reshape(B, T),
        student_logits=r(B, T, V).requires_grad_(True),
        teacher_logits=r(B, T, V),
        chosen_logps=r(2).requires_grad_(True),
        rejected_logps=r(2).requires_grad_(True),
        ref_chosen_logps=r(2),
        ref_rejected_logps=r(2),
    )
    return (
        b
        if pairs
        else dataclasses.replace(
            b, chosen_logps=None, rejected_logps=None, ref_chosen_logps=None, ref_rejected_logps=None
        )
    )


# ------------------------------------------------------------------------------------------------ w_policy
def test_w_policy_weights_the_policy_term() -> None:
    b = _batch(pairs=True)
    one = compose_loss(b, alpha_sdpo=0.7, beta_replay=0.2)
    assert one.policy is not None and one.sdpo is not None and one.replay is not None
    for w in (0.25, 2.0):
        r = compose_loss(b, w_policy=w, alpha_sdpo=0.7, beta_replay=0.2)
        assert r.policy is not None and torch.equal(r.policy, one.policy)
        torch.testing.assert_close(
            r.total, w * one.policy + 0.7 * one.sdpo + 0.2 * one.replay, rtol=0, atol=1e-15
        )
    assert torch.equal(compose_loss(b, w_policy="1", alpha_sdpo=0.7, beta_replay=0.2).total, one.total)


def test_w_policy_zero_never_computes_the_policy_term(monkeypatch: pytest.MonkeyPatch) -> None:
    b = _batch()
    ref = compose_loss(b, alpha_sdpo=0.5)

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("policy_loss called under w_policy=0")

    monkeypatch.setattr(compose_module, "policy_loss", boom)
    r = compose_loss(b, w_policy=0.0, alpha_sdpo=0.5)
    assert r.policy is None and r.sdpo is not None and ref.sdpo is not None
    assert torch.equal(r.sdpo, ref.sdpo) and torch.equal(r.total, 0.5 * ref.sdpo)
    assert r.metrics["policy/skipped"] == 1.0 and "loss/policy" not in r.metrics
    # a micro-batch without channel-2 inputs (pure self-distillation): a zero with a graph, zero gradients
    bare = dataclasses.replace(
        b, student_logits=None, teacher_logits=None, chosen_logps=None, rejected_logps=None
    )
    z = compose_loss(bare, w_policy="0", alpha_sdpo=1.0)
    z.total.backward()
    assert float(z.total) == 0.0 and b.logprobs.grad is not None and not b.logprobs.grad.any()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            {"w_policy": 0.0, "alpha_sdpo": 0.0, "beta_replay": 0.0},
            r"all 0: nothing to train; set w_policy=1",
        ),
        ({"w_policy": 0.0, "alpha_sdpo": 1.0, "kl_beta": 0.1}, r"`kl_beta`=0.1 is part of the policy term"),
        ({"w_policy": -1.0}, r"`w_policy`=-1.0 must be a finite weight >= 0"),
        ({"w_policy": float("inf")}, r"`w_policy`=inf"),
    ],
)
def test_w_policy_refusals(options: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ComposeConfig.from_flat(**options)


# ------------------------------------------------------------------------------------------------ IS clip
CLIP = 1.3


def _weight(b: ComposerBatch) -> torch.Tensor:
    assert b.old_logprobs is not None
    w = torch.exp((b.logprobs.detach() - b.old_logprobs).clamp(-20, 20)).clamp(max=CLIP)
    assert (w < CLIP).any() and (w == CLIP).any()  # both sides of the clip are exercised
    return w


def _clipped_mean(per_token: torch.Tensor, b: ComposerBatch) -> torch.Tensor:
    m = b.completion_mask.bool()
    return (per_token * _weight(b))[m].sum() / m.sum()


def test_is_clip_weight_is_trls_formula() -> None:
    b = _batch()
    w = is_clip_weight(b.logprobs, b.old_logprobs, CLIP)
    assert w is not None and not w.requires_grad and torch.equal(w, _weight(b))
    assert (
        is_clip_weight(b.logprobs, None, CLIP) is None
        and is_clip_weight(b.logprobs, b.old_logprobs, None) is None
    )
    trl_utils = pytest.importorskip("trl.experimental.sdpo.loss_utils")
    ones = torch.ones(B, T, dtype=D)
    assert torch.equal(
        trl_utils.apply_importance_sampling_clipping(ones, b.logprobs, b.old_logprobs, CLIP), w
    )


@pytest.mark.parametrize("form", ["full", "fused", "topk_tail", "topk", "sampled"])
def test_is_clip_applies_on_every_form(form: str) -> None:
    b = _batch()
    assert b.student_logits is not None and b.teacher_logits is not None
    opts: dict[str, object] = {"sdpo_token_clip": CLIP, "beta_replay": 0.0, "sdpo_beta": 0.5}
    if form == "full":
        per_token = generalized_jsd(b.student_logits, b.teacher_logits, beta=0.5, reduction="none")
    elif form == "fused":
        g = torch.Generator().manual_seed(1)
        hs, ht = torch.randn(B, T, H, generator=g, dtype=D), torch.randn(B, T, H, generator=g, dtype=D)
        head = torch.randn(V, H, generator=g, dtype=D)
        b = dataclasses.replace(
            b, student_logits=None, teacher_logits=None, student_hidden=hs, teacher_hidden=ht
        )
        b.lm_head_weight = head
        per_token = generalized_jsd(hs @ head.T, ht @ head.T, beta=0.5, reduction="none")
    elif form.startswith("topk"):
        tail = form == "topk_tail"
        opts |= {"sdpo_topk": 3, "sdpo_topk_tail": tail}
        per_token = topk_distill(
            b.student_logits, b.teacher_logits, k=3, beta=0.5, add_tail_bucket=tail, reduction="none"
        )
    else:
        lt = b.logprobs.detach() - 0.3
        b = dataclasses.replace(b, student_logits=None, teacher_logits=None, teacher_logprobs=lt)
        opts = {"sdpo_token_clip": CLIP, "beta_replay": 0.0}
        per_token = (b.logprobs - lt).detach()  # the k1 value the sampled form reports
    clipped = compose_loss(b, **opts)
    assert clipped.sdpo is not None
    torch.testing.assert_close(clipped.sdpo, _clipped_mean(per_token.detach(), b), rtol=1e-12, atol=1e-14)
    unclipped = compose_loss(b, **{**opts, "sdpo_token_clip": None})
    assert unclipped.sdpo is not None and not torch.allclose(unclipped.sdpo, clipped.sdpo)
    on_policy = compose_loss(dataclasses.replace(b, old_logprobs=None), **opts)  # no old log-probs: no clip
    assert on_policy.sdpo is not None and torch.equal(on_policy.sdpo, unclipped.sdpo)


@pytest.mark.parametrize("seq_mean", [False, True])
def test_gradcheck_clipped_full_forms(seq_mean: bool) -> None:
    """float64 gradcheck of the clipped full-vocabulary loss (logits and fused hidden states), the weight held
    fixed (it is a stop-gradient of ℓθ, which is not varied)."""
    b = _batch(3)
    agg = {"sdpo_loss_agg": "seq_mean"} if seq_mean else {}
    opts = {"sdpo_token_clip": CLIP, "beta_replay": 0.0, "w_policy": 0.0, "sdpo_chunk_size": 2, **agg}

    def logits(s: torch.Tensor) -> torch.Tensor:
        return compose_loss(dataclasses.replace(b, student_logits=s), **opts).total

    assert torch.autograd.gradcheck(logits, (b.student_logits,), fast_mode=True)
    g = torch.Generator().manual_seed(2)
    hs = torch.randn(B, T, H, generator=g, dtype=D, requires_grad=True)
    head = torch.randn(V, H, generator=g, dtype=D, requires_grad=True)
    fused = dataclasses.replace(
        b,
        student_logits=None,
        teacher_logits=None,
        teacher_hidden=torch.randn(B, T, H, generator=g, dtype=D),
        teacher_lm_head_weight=head.detach().clone(),  # the teacher's head held fixed (stop-gradient side)
    )

    def hidden(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return compose_loss(dataclasses.replace(fused, student_hidden=h, lm_head_weight=w), **opts).total

    assert torch.autograd.gradcheck(hidden, (hs, head), fast_mode=True)
