from __future__ import annotations

import math

import pytest
import torch
from composer_core import (
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
