from __future__ import annotations

import math

import pytest
import torch
from composer_core import (
    PolicyOptions,
    aggregate_loss,
    clipped_surrogate,
    dppo_loss,
    dppo_mask,
    group_advantages,
    kl_penalty,
    overlong_reward_shaping,
    policy_loss,
    rollout_correction_weights,
)

D = torch.float64


# ------------------------------------------------------------------ advantages
def test_group_advantages_check_values() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=D)
    a = group_advantages(r, 4)
    # std (Bessel) = 0.5 -> (r - 0.25) / (0.5 + 1e-4)
    torch.testing.assert_close(a, (r - 0.25) / 0.5001)
    assert a[0].item() == pytest.approx(1.49970, abs=1e-5)
    torch.testing.assert_close(
        group_advantages(r, 4, eps=0.0), torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=D)
    )
    torch.testing.assert_close(
        group_advantages(r, 4, scale="none"), torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=D)
    )


def test_group_advantages_groups_ids_batch_scale_singletons_zero_std() -> None:
    r = torch.tensor([1.0, 5.0, 0.0, 5.0, 3.0], dtype=D)
    a = group_advantages(r, group_ids=["a", "b", "a", "b", "c"], eps=0.0)
    # group a: [1, 0] mean .5 std sqrt(.5); group b: zero std -> 0; group c singleton -> 0 (TRL)
    s = math.sqrt(0.5)
    torch.testing.assert_close(a, torch.tensor([0.5 / s, 0.0, -0.5 / s, 0.0, 0.0], dtype=D))
    # contiguous groups of 2 (num_generations=2): Bessel std |r1 - r2| / sqrt(2), the same as by ids
    pairs = torch.tensor([1.0, 0.0, 0.0, 3.0], dtype=D)
    by_size = group_advantages(pairs, 2, eps=0.0)
    torch.testing.assert_close(by_size, torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=D) * s)
    torch.testing.assert_close(group_advantages(pairs, group_ids=[0, 0, 1, 1], eps=0.0), by_size)
    six = torch.tensor([1.0, 0.0, 0.0, 2.0, 5.0, 3.0], dtype=D)  # and groups of 3
    torch.testing.assert_close(group_advantages(six, group_ids=[7, 7, 7, 8, 8, 8]), group_advantages(six, 3))
    a_v = group_advantages(r, group_ids=torch.tensor([0, 1, 0, 1, 2]), eps=0.0, singleton="reward")
    assert a_v[4].item() == 3.0
    r2 = torch.tensor([1.0, 0.0, 2.0, 2.0], dtype=D)
    ab = group_advantages(r2, 2, scale="batch", eps=0.0)
    torch.testing.assert_close(ab, torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=D) / r2.std())
    # an all-equal group is exactly zero even when the mean is inexact in floating point
    assert torch.equal(group_advantages(torch.full((3,), 0.1, dtype=D), 3), torch.zeros(3, dtype=D))


def test_overlong_reward_shaping() -> None:
    lengths = torch.tensor([10, 16, 18, 20, 21])
    out = overlong_reward_shaping(lengths, max_length=20, cache_length=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(
        overlong_reward_shaping(lengths, 20, 4, penalty_factor=0.5),
        torch.tensor([0.0, 0.0, -0.25, -0.5, -0.5]),
    )
    # the bounds 1 <= cache_length <= max_length are both valid
    torch.testing.assert_close(
        overlong_reward_shaping(torch.tensor([9, 10, 11]), 10, 1), torch.tensor([0.0, -1.0, -1.0])
    )
    torch.testing.assert_close(
        overlong_reward_shaping(torch.tensor([0, 5, 11]), 10, 10), torch.tensor([0.0, -0.5, -1.0])
    )


# ------------------------------------------------------------------ KL / surrogate
def test_kl_estimators_check_values() -> None:
    lp = torch.tensor([math.log(0.5)], dtype=D)
    ref = torch.tensor([math.log(0.25)], dtype=D)
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.69315, abs=1e-5)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.24023, abs=1e-5)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.19315, abs=1e-5)


def test_clipped_surrogate_check_values() -> None:
    loss, clipped = clipped_surrogate(
        torch.tensor([[math.log(1.5)]], dtype=D),
        torch.zeros(1, 1, dtype=D),
        torch.tensor([1.0], dtype=D),
        epsilon_high=0.28,
    )
    assert loss.item() == pytest.approx(-1.28, abs=1e-12) and bool(clipped.item())
    loss, _ = clipped_surrogate(
        torch.tensor([[math.log(0.5)]], dtype=D), torch.zeros(1, 1, dtype=D), torch.tensor([-1.0], dtype=D)
    )
    assert loss.item() == pytest.approx(0.8, abs=1e-12)
    # DAPO check: ρ=1.25, A>0 unclipped at ε_high=0.28, clipped to 1.2 under symmetric 0.2
    lp = torch.tensor([[math.log(1.25)]], dtype=D)
    assert clipped_surrogate(lp, torch.zeros(1, 1, dtype=D), torch.ones(1, dtype=D), epsilon_high=0.28)[
        0
    ].item() == pytest.approx(-1.25)
    assert clipped_surrogate(lp, torch.zeros(1, 1, dtype=D), torch.ones(1, dtype=D))[
        0
    ].item() == pytest.approx(-1.2)
    # delta caps the unclipped branch for A<0: ρ=5, A=-1 -> min(5,3)*-1 vs 1.2*-1 -> loss = 3
    big = torch.tensor([[math.log(5.0)]], dtype=D)
    assert clipped_surrogate(big, torch.zeros(1, 1, dtype=D), -torch.ones(1, dtype=D), delta=3.0)[
        0
    ].item() == pytest.approx(3.0)
    assert clipped_surrogate(big, torch.zeros(1, 1, dtype=D), -torch.ones(1, dtype=D))[
        0
    ].item() == pytest.approx(5.0)


# ------------------------------------------------------------------ aggregation
def test_aggregate_loss_types_closed_form() -> None:
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=D)
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate_loss(L, m, "grpo").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate_loss(L, m, "grpo", normalizer=4).item() == pytest.approx((2.0 + 4.0) / 4)
    assert aggregate_loss(L, m, "bnpo").item() == pytest.approx(10.0 / 4)
    assert aggregate_loss(L, m, "dapo").item() == pytest.approx(10.0 / 4)
    assert aggregate_loss(L, m, "dapo", normalizer=8).item() == pytest.approx(10.0 / 8)
    assert aggregate_loss(L, m, "dr_grpo").item() == pytest.approx(10.0 / 6)
    one = torch.tensor([[0, 0, 1], [0, 0, 0]])  # a single kept token: the token means are that token
    assert aggregate_loss(L, one, "bnpo").item() == 3.0 and aggregate_loss(L, one, "dapo").item() == 3.0
    # grpo (TRL): the per-sequence means, averaged over every sequence, the empty one included
    assert aggregate_loss(L, one, "grpo").item() == 1.5
    assert aggregate_loss(L, m, "dr_grpo", max_completion_length=5).item() == pytest.approx(10.0 / 10)
    assert aggregate_loss(L, m, "dr_grpo", normalizer=20).item() == pytest.approx(10.0 / 20)


# ------------------------------------------------------------------ rollout correction
def test_rollout_correction_check_values() -> None:
    lp = torch.tensor([[math.log(3.0), math.log(0.4)]], dtype=D)
    inf = torch.zeros(1, 2, dtype=D)
    m = torch.ones(1, 2)
    tis = rollout_correction_weights(lp, inf, m, mode="token_truncate", clip_max=2.0)
    torch.testing.assert_close(tis, torch.tensor([[2.0, 0.4]], dtype=D))
    mis3 = rollout_correction_weights(lp, inf, m, mode="token_mask", clip_max=3.0 + 1e-9)
    torch.testing.assert_close(mis3, torch.tensor([[3.0, 0.4]], dtype=D))
    mis2 = rollout_correction_weights(lp, inf, m, mode="token_mask", clip_max=2.0)
    assert mis2[0, 0].item() == 0.0
    icepop = rollout_correction_weights(lp, inf, m, mode="token_mask", clip_min=0.5, clip_max=5.0)
    torch.testing.assert_close(icepop, torch.tensor([[3.0, 0.0]], dtype=D))
    # clip_min = 0 is a valid bound (nothing below it to mask)
    floor0 = rollout_correction_weights(lp, inf, m, mode="token_mask", clip_min=0.0, clip_max=5.0)
    torch.testing.assert_close(floor0, torch.tensor([[3.0, 0.4]], dtype=D))
    seq = rollout_correction_weights(lp, inf, m, mode="sequence_truncate", clip_max=10.0)
    torch.testing.assert_close(seq, torch.full((1, 2), 1.2, dtype=D))
    seqm = rollout_correction_weights(lp, inf, m, mode="sequence_mask", clip_max=1.1)
    torch.testing.assert_close(seqm, torch.zeros(1, 2, dtype=D))


def test_dppo_mask_check_values() -> None:
    lp = torch.tensor([[math.log(0.9)]], dtype=D)
    inf = torch.tensor([[math.log(0.6)]], dtype=D)
    assert bool(dppo_mask(lp, inf, torch.tensor([1.0], dtype=D)).item())
    assert not bool(dppo_mask(lp, inf, torch.tensor([-1.0], dtype=D)).item())
    assert bool(dppo_mask(inf, lp, torch.tensor([-1.0], dtype=D)).item())


def test_dppo_loss_closed_form_and_grad() -> None:
    lp = torch.tensor([[math.log(0.5), math.log(0.9)]], dtype=D, requires_grad=True)
    inf = torch.tensor([[math.log(0.4), math.log(0.6)]], dtype=D)
    adv = torch.tensor([2.0], dtype=D)
    per_tok, metrics = dppo_loss(lp, inf, adv, torch.ones(1, 2), kl_tau=0.01)
    d0 = math.log(0.5 / 0.4)
    d1 = math.log(0.9 / 0.6)
    torch.testing.assert_close(per_tok, torch.tensor([[-2.0 * 1.25 + 0.01 * d0**2, 0.01 * d1**2]], dtype=D))
    assert metrics["masked_fraction"].item() == pytest.approx(0.5)


# ------------------------------------------------------------------ policy_loss
def test_policy_loss_default_is_dapo_with_ratio_one() -> None:
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 4, generator=g, dtype=D).requires_grad_(True)
    adv = torch.randn(3, generator=g, dtype=D)
    m = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    out = policy_loss(lp, adv, m)
    # ratio 1: loss = -Σ A·m / Σ m ; gradient = -A·m/Σm
    expected = -(adv[:, None] * m).sum() / m.sum()
    assert out.loss.item() == pytest.approx(expected.item(), abs=1e-12)
    (g_lp,) = torch.autograd.grad(out.loss, lp)
    torch.testing.assert_close(g_lp, -(adv[:, None] * m) / m.sum())
    assert out.metrics["policy/clip_ratio"] == 0.0


def _inputs(seed: int = 0, b: int = 3, t: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = (torch.rand(b, t, generator=g, dtype=D) * -2 - 0.05).requires_grad_(True)
    return {
        "logprobs": lp,
        "old": lp.detach() + 0.3 * torch.randn(b, t, generator=g, dtype=D),
        "ref": lp.detach() + 0.2 * torch.randn(b, t, generator=g, dtype=D),
        "inf": lp.detach() + 0.4 * torch.randn(b, t, generator=g, dtype=D),
        "adv": torch.randn(b, generator=g, dtype=D),
        "mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]][:b]),
    }


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_gradcheck_policy_loss(loss_type: str) -> None:
    x = _inputs()
    for kwargs in (
        {"kl_beta": 0.1, "epsilon_high": 0.28},
        {"rollout_correction": "token_truncate", "delta": 1.6},
        {"rollout_correction": "dppo_mask", "kl_estimator": "k2", "kl_beta": 0.05},
    ):
        kw = dict(kwargs)
        ref = x["ref"] if "kl_beta" in kw else None
        inf = x["inf"] if "rollout_correction" in kw else None
        assert torch.autograd.gradcheck(
            lambda lp, kw=kw, ref=ref, inf=inf: (
                policy_loss(
                    lp,
                    x["adv"],
                    x["mask"],
                    old_logprobs=x["old"],
                    ref_logprobs=ref,
                    inference_logprobs=inf,
                    options=PolicyOptions(loss_type=loss_type, **kw),  # type: ignore[arg-type]
                ).loss
            ),
            (x["logprobs"],),
        )


def test_gradcheck_dppo_loss_and_kl() -> None:
    x = _inputs(1)
    assert torch.autograd.gradcheck(
        lambda lp: dppo_loss(lp, x["inf"], x["adv"], x["mask"])[0], (x["logprobs"],)
    )
    for est in ("k1", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda lp, e=est: kl_penalty(lp, x["ref"], e), (x["logprobs"],))  # type: ignore[misc]


def test_policy_loss_matches_manual_composition() -> None:
    """Surrogate × IS weight + β·KL, then aggregation — every kwarg changes the result."""
    x = _inputs(2)
    lp, m = x["logprobs"], x["mask"]
    base = dict(old_logprobs=x["old"])
    surr, _ = clipped_surrogate(lp, x["old"], x["adv"], epsilon_high=0.28)
    w = rollout_correction_weights(x["old"], x["inf"], m, mode="token_mask", clip_min=0.5, clip_max=1.5)
    kl = kl_penalty(lp, x["ref"], "k1")
    manual = aggregate_loss(surr * w + 0.1 * kl, m, "dapo")
    out = policy_loss(
        lp,
        x["adv"],
        m,
        ref_logprobs=x["ref"],
        inference_logprobs=x["inf"],
        options=PolicyOptions(
            loss_type="dapo",
            epsilon_high=0.28,
            kl_beta=0.1,
            kl_estimator="k1",
            rollout_correction="token_mask",
            rollout_clip_min=0.5,
            rollout_clip_max=1.5,
        ),
        **base,
    )
    assert torch.equal(out.loss, manual)
    assert set(out.metrics) == {"policy/clip_ratio", "policy/kl", "policy/rollout_is_weight"}
    masked_mean = lambda v: float((v * m).sum() / m.sum())  # noqa: E731
    assert out.metrics["policy/rollout_is_weight"] == pytest.approx(masked_mean(w), rel=1e-12)
    assert out.metrics["policy/kl"] == pytest.approx(masked_mean(kl), rel=1e-12)
    given = policy_loss(lp, x["adv"], m, rollout_is_weights=torch.full_like(lp, 0.5), **base)
    assert given.metrics["policy/rollout_is_weight"] == pytest.approx(0.5, rel=1e-12)
    ref_out = policy_loss(lp, x["adv"], m, **base)
    # the given weights multiply the per-token loss (dapo aggregates linearly)
    assert given.loss.item() == pytest.approx(0.5 * ref_out.loss.item(), rel=1e-12)
    for opts, kw in (
        ({"epsilon_low": 0.1}, {}),
        ({"epsilon_high": 0.5}, {}),
        ({}, {"normalizer": 100.0}),
        ({}, {"rollout_is_weights": torch.full_like(lp, 0.5)}),
        (
            {"rollout_correction": "sequence_truncate", "rollout_clip_max": 1.0},
            {"inference_logprobs": x["inf"]},
        ),
        (
            {"rollout_correction": "dppo_mask", "dppo_mask_low": 0.0, "dppo_mask_high": 0.0},
            {"inference_logprobs": x["inf"]},
        ),
        ({"loss_type": "dr_grpo", "max_completion_length": 9}, {}),
    ):
        changed = policy_loss(lp, x["adv"], m, options=PolicyOptions(**opts), **{**base, **kw})  # type: ignore[arg-type]
        assert changed.loss.item() != pytest.approx(ref_out.loss.item(), abs=1e-9), (opts, kw)
    # delta reaches the surrogate through policy_loss: ρ = e^0.5 > delta, A < 0
    far_old = lp.detach() - 0.5
    neg = -x["adv"].abs()
    no_delta = policy_loss(lp, neg, m, old_logprobs=far_old).loss
    with_delta = policy_loss(lp, neg, m, old_logprobs=far_old, options=PolicyOptions(delta=1.25)).loss
    assert with_delta.item() == pytest.approx(no_delta.item() * 1.25 / math.exp(0.5), rel=1e-12)
    # dppo thresholds: masked tokens drop out of the surrogate and are reported
    dp = policy_loss(
        lp,
        x["adv"],
        m,
        inference_logprobs=x["inf"],
        options=PolicyOptions(rollout_correction="dppo_mask", dppo_mask_low=0.0, dppo_mask_high=0.0),
    )
    assert dp.metrics["policy/dppo_masked"] > 0


def test_dppo_mask_counts_a_zero_advantage_as_non_positive() -> None:
    """PRIME-RL's DPPO: ``(A>0 ∧ Δp > high) ∨ (A≤0 ∧ Δp < −low)``; A = 0 (a group with one reward) is the A ≤ 0 side."""
    lp = torch.log(torch.tensor([[0.2, 0.9]], dtype=D))
    inf = torch.log(torch.tensor([[0.6, 0.5]], dtype=D))  # Δp = −0.4 (fell past −low), +0.4 (rose past high)
    assert dppo_mask(lp, inf, torch.zeros(1, dtype=D)).tolist() == [[True, False]]
    assert dppo_mask(lp, inf, torch.ones(1, dtype=D)).tolist() == [[False, True]]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_global_normalizer_makes_gradient_accumulation_exact(loss_type: str) -> None:
    x = _inputs(3, b=4, t=5)
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    lp = (torch.rand(4, 5, dtype=D, generator=torch.Generator().manual_seed(5)) * -2).requires_grad_(True)
    adv = x["adv"].repeat(2)[:4]
    opts = PolicyOptions(loss_type=loss_type)  # type: ignore[arg-type]
    full = policy_loss(lp, adv, m, options=opts).loss
    (g_full,) = torch.autograd.grad(full, lp)
    norm = {"grpo": 4.0, "dr_grpo": 4.0 * 5, "dapo": float(m.sum())}[loss_type]
    g_acc = torch.zeros_like(lp)
    total = 0.0
    for rows in ([0, 1], [2, 3]):
        part = policy_loss(lp[rows], adv[rows], m[rows], options=opts, normalizer=norm).loss
        (g,) = torch.autograd.grad(part, lp)
        g_acc += g
        total += part.item()
    assert total == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(g_acc, g_full, rtol=1e-12, atol=1e-14)


def test_policy_bad_inputs() -> None:
    x = _inputs(4)
    lp, adv, m = x["logprobs"], x["adv"], x["mask"]
    nan = lp.detach().clone()
    nan[0, 0] = float("nan")
    cases: list[tuple[object, str]] = [
        (lambda: policy_loss(nan, adv, m), "logprobs.*NaN"),
        (lambda: policy_loss(lp, adv * float("inf"), m), "advantages.*NaN/inf"),
        (lambda: policy_loss(lp, adv[:2], m), "advantages"),
        (lambda: policy_loss(lp, adv, m[:, :2]), "mask.*shape"),
        (lambda: policy_loss(lp, adv, m, old_logprobs=x["old"][:, :2]), "old_logprobs.*shape"),
        (lambda: PolicyOptions(loss_type="ppo"), "loss_type"),  # type: ignore[arg-type]
        (lambda: policy_loss(lp, adv, m, options=PolicyOptions(kl_beta=0.1)), "ref_logprobs"),
        (lambda: policy_loss(lp, adv, m, ref_logprobs=x["ref"]), "kl_beta"),
        (
            lambda: policy_loss(lp, adv, m, options=PolicyOptions(rollout_correction="token_mask")),
            "inference_logprobs",
        ),
        (lambda: policy_loss(lp, adv, m, inference_logprobs=x["inf"]), "rollout_correction"),
        (
            lambda: policy_loss(
                lp,
                adv,
                m,
                inference_logprobs=x["inf"],
                options=PolicyOptions(rollout_correction="token_mask"),
                rollout_is_weights=torch.ones_like(lp),
            ),
            "not both",
        ),
        (lambda: PolicyOptions(rollout_correction="tis"), "rollout_correction"),  # type: ignore[arg-type]
        (lambda: PolicyOptions(delta=1.1), "delta"),
        (lambda: PolicyOptions(epsilon_low=1.5), "epsilon_low"),
        (lambda: policy_loss(lp, adv, m, options=PolicyOptions(loss_type="bnpo"), normalizer=3), "bnpo"),
        (lambda: policy_loss(lp, adv, m, normalizer=0), "normalizer"),
        (lambda: PolicyOptions(max_completion_length=8), "max_completion_length"),
        (
            lambda: policy_loss(
                lp, adv, m, options=PolicyOptions(loss_type="dr_grpo", max_completion_length=2)
            ),
            "max_completion_length",
        ),
        (
            lambda: policy_loss(
                lp, adv, m, options=PolicyOptions(loss_type="dr_grpo", max_completion_length=8), normalizer=3
            ),
            "not both",
        ),
        (lambda: kl_penalty(lp, x["ref"], "k4"), "estimator"),  # type: ignore[arg-type]
        (
            lambda: rollout_correction_weights(lp, x["inf"], m, mode="token_mask", clip_min=2, clip_max=1),
            "clip_min",
        ),
        (lambda: dppo_mask(lp, x["inf"], adv, mask_low=2.0), "mask_low"),
        (lambda: dppo_mask(lp, x["inf"], adv, mask_high=1.2), "mask_high"),  # a probability difference <= 1
        (lambda: group_advantages(torch.ones(5), 2), "multiple"),
        (lambda: group_advantages(torch.ones(4)), "group_size"),
        (lambda: group_advantages(torch.ones(4), 0), r"`group_size`=0 must be an int >= 1"),
        (lambda: group_advantages(torch.ones(4), True), r"`group_size`=True must be an int"),  # not a 1
        (lambda: group_advantages(torch.ones(4), "2"), r"`group_size`='2' must be an int"),  # type: ignore[arg-type]
        (lambda: group_advantages(torch.ones(4), 2, group_ids=[0, 0, 1, 1]), "not both"),
        (lambda: group_advantages(torch.ones(4), group_ids=[0, 1]), "group_ids"),
        (lambda: group_advantages(torch.tensor([1.0, float("nan")]), 2), "rewards.*NaN"),
        (lambda: group_advantages(torch.ones(4), 2, scale="std"), "scale"),  # type: ignore[arg-type]
        (lambda: overlong_reward_shaping(torch.tensor([1, 2]), 10, 20), "cache_length"),
        (lambda: overlong_reward_shaping(torch.tensor([-1, 2]), 10, 2), "lengths"),
        (lambda: overlong_reward_shaping(torch.tensor([1, 2]), 10.0, 2), "must be ints"),  # type: ignore[arg-type]
    ]
    for fn, match in cases:
        assert callable(fn)
        with pytest.raises(ValueError, match=match):
            fn()


def test_advantages_are_batch_of_tk_broadcast() -> None:
    x = _inputs(6)
    lp, m = x["logprobs"], x["mask"]
    per_sample = policy_loss(lp, x["adv"], m).loss
    for adv in (x["adv"][:, None].expand(3, 4).contiguous(), x["adv"][:, None]):  # [B, T] and [B, 1]
        assert torch.equal(policy_loss(lp, adv, m).loss, per_sample)


def test_dppo_loss_kwargs() -> None:
    lp = torch.tensor([[math.log(0.5), math.log(0.9)]], dtype=D)
    inf = torch.tensor([[math.log(0.4), math.log(0.6)]], dtype=D)
    adv = torch.tensor([2.0], dtype=D)
    m = torch.ones(1, 2)
    base, _ = dppo_loss(lp, inf, adv, m, kl_tau=0.0)
    torch.testing.assert_close(base, torch.tensor([[-2.5, 0.0]], dtype=D))  # Δp = .3 > .2: token 2 masked
    tau, _ = dppo_loss(lp, inf, adv, m, kl_tau=0.0, adv_tau=0.5)
    torch.testing.assert_close(tau, 0.5 * base)
    wide, met = dppo_loss(lp, inf, adv, m, kl_tau=0.0, mask_high=0.35)
    torch.testing.assert_close(wide, torch.tensor([[-2.5, -3.0]], dtype=D))
    assert met["masked_fraction"].item() == 0.0
    log_ratio = lp - inf  # mismatch_kl: the masked mean of ½·log²(π/π_inf)
    assert met["mismatch_kl"].item() == pytest.approx(float((0.5 * log_ratio**2).mean()), rel=1e-12)
    neg, _ = dppo_loss(inf, lp, -adv, m, kl_tau=0.0, mask_low=0.35)  # Δp = −.3 > −.35: kept
    torch.testing.assert_close(neg, torch.tensor([[2.0 * 0.4 / 0.5, 2.0 * 0.6 / 0.9]], dtype=D))


def test_kl_bias_correction_weights_the_k3_kl_by_the_unclipped_ratio() -> None:
    """TRL's use_bias_correction_kl=True: L_t = −min(ρA, clip(ρ)A) + β·ρ·k3_t (ρ not clamped by δ)."""
    g = torch.Generator().manual_seed(4)
    lp = (torch.randn(3, 4, generator=g, dtype=torch.float64) - 1).requires_grad_()
    old = lp.detach() + 0.4 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    ref = lp.detach() + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 4)
    out = policy_loss(
        lp, adv, mask, old_logprobs=old, ref_logprobs=ref,
        options=PolicyOptions(kl_beta=0.1, kl_bias_correction=True, delta=1.5, loss_type="bnpo"),
    )  # fmt: skip
    rho = torch.exp(lp - old)
    k3 = torch.exp(ref - lp) - (ref - lp) - 1
    a = adv.unsqueeze(1)
    surrogate = -torch.min(rho.clamp(max=1.5) * a, rho.clamp(0.8, 1.2) * a)
    expected = (surrogate + 0.1 * rho * k3).mean()
    torch.testing.assert_close(out.loss, expected, rtol=1e-13, atol=0.0)
    assert out.metrics["policy/kl"] == pytest.approx(float((rho * k3).mean()), rel=1e-12)
    plain = policy_loss(
        lp, adv, mask, old_logprobs=old, ref_logprobs=ref,
        options=PolicyOptions(kl_beta=0.1, loss_type="bnpo", delta=1.5),
    )  # fmt: skip
    assert abs(plain.loss.item() - out.loss.item()) > 1e-6
    with pytest.raises(ValueError, match="kl_bias_correction"):
        PolicyOptions(kl_bias_correction=True)
