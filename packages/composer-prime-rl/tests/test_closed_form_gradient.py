"""``composer_loss`` writes its gradient out (one multiply in backward, no autograd graph of the formula):
it must equal autograd through the same formulas, ties included. The reference here differentiates the
textbook forms with autograd: DPPO + KL as PRIME-RL's ``default_loss_fn`` writes it, the PPO/GRPO clipped
surrogate through ``composer_core``'s ``clipped_surrogate_from_ratio`` (TRL's op order), channel 2 through
``composer_core``'s ``sampled_token_distill``."""

from __future__ import annotations

import math

import pytest
import torch
from composer_core.loss.distill import sampled_token_distill
from composer_core.loss.policy import clipped_surrogate_from_ratio
from composer_prime_rl import LossInputs, composer_loss

EPS_LO, EPS_HI, DELTA = 0.2, 0.28, 1.5


def _rounding_tie(bound: float, sign: float) -> tuple[float, float, float]:
    """(ℓ_inf, ℓ_train, A) with ρ = e^{ℓ_train − ℓ_inf} one step outside ``bound`` (above 1 + ε_hi when
    ``sign`` > 0, below 1 − ε_lo otherwise; A of that sign, so the clipped side is the smaller) and ρ·A ==
    bound·A in float64."""
    inf = torch.tensor(math.log(0.5), dtype=torch.float64)
    for k in range(1, 100):
        lp = inf + math.log(bound) + sign * k * 1e-16
        rho = torch.exp(lp - inf)
        if (rho - bound).item() * sign <= 0:
            continue
        for adv in torch.linspace(0.1, 3.0, 3001, dtype=torch.float64) * sign:
            if (rho * adv).item() == (torch.clamp(rho, 1 - EPS_LO, 1 + EPS_HI) * adv).item():
                return inf.item(), lp.item(), adv.item()
    raise AssertionError(f"no rounding tie found at {bound}")


def _inputs(seed: int, ties: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = 64
    inf = torch.rand(n, generator=g, dtype=torch.float64).mul(0.9).add(0.05).log()
    lp = inf + torch.randn(n, generator=g, dtype=torch.float64) * 0.4
    if ties:  # exact ties of the min/clamp branches: ρ = 1 (on-policy), ρ = 1 + ε_hi, ρ = 1 − ε_lo, ρ = δ
        lp[:8] = inf[:8]
        lp[8:12] = inf[8:12] + math.log(1 + EPS_HI)
        lp[12:16] = inf[12:16] + math.log(1 - EPS_LO)
        lp[16:20] = inf[16:20] + math.log(DELTA)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[::7] = 0.0
    if ties:
        # ρ just outside the clip range with ρ·A and clip(ρ)·A rounding to one value: a tie autograd splits
        for i, (bound, sign) in zip(range(20, 24), [(1 + EPS_HI, 1.0), (1 - EPS_LO, -1.0)] * 2, strict=True):
            inf[i], lp[i], adv[i] = _rounding_tie(bound, sign)
    mask = torch.rand(n, generator=g) > 0.2
    if ties:
        mask[20:24] = True
    return {
        "lp": lp,
        "inf": inf,
        "ref": torch.rand(n, generator=g, dtype=torch.float64).mul(0.9).add(0.05).log(),
        "adv": adv,
        "mask": mask,
        "w": torch.rand(n, generator=g, dtype=torch.float64) + 0.5,
    }


def _reference(x: dict[str, torch.Tensor], lp: torch.Tensor, kwargs: dict, weighted: bool) -> torch.Tensor:
    m, adv = x["mask"], x["adv"]
    log_ratio = torch.where(m, lp, 0.0) - torch.where(m, x["inf"], 0.0)
    ratio = torch.exp(log_ratio)
    if kwargs.get("policy_loss") == "clipped_surrogate":
        per_token, _ = clipped_surrogate_from_ratio(
            ratio, torch.where(m, adv, 0.0), EPS_LO, EPS_HI, kwargs.get("delta")
        )
    else:  # PRIME-RL's default_loss_fn (DPPO + KL), adv_tau = 1, kl_tau = 1e-3, mask bounds 0.2
        dp = torch.exp(lp) - torch.exp(x["inf"])
        masked = torch.where(adv > 0, dp > 0.2, dp < -0.2)
        keep = m & ~masked
        per_token = -(keep * adv * ratio) + 1e-3 * m.double() * log_ratio**2
    if kwargs.get("alpha_sdpo"):
        distill = sampled_token_distill(
            lp[None], x["ref"][None], m[None], old_logprobs=x["inf"][None], is_clip=2.0, reduction="none"
        )[0]
        per_token = per_token + kwargs["alpha_sdpo"] * distill
    per_token = torch.where(m, per_token, 0.0)
    return (per_token * x["w"] if weighted else per_token).sum()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"alpha_sdpo": 0.5},
        {"policy_loss": "clipped_surrogate", "epsilon_low": EPS_LO, "epsilon_high": EPS_HI},
        {"policy_loss": "clipped_surrogate", "epsilon_low": EPS_LO, "epsilon_high": EPS_HI, "delta": DELTA},
        {
            "policy_loss": "clipped_surrogate",
            "epsilon_low": EPS_LO,
            "epsilon_high": EPS_HI,
            "alpha_sdpo": 2.0,
        },
    ],
    ids=["dppo", "dppo+sdpo", "clipped", "clipped+delta", "clipped+sdpo"],
)
@pytest.mark.parametrize("ties", [False, True], ids=["generic", "ties"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_gradient_equals_autograd_through_the_formula(kwargs: dict, ties: bool, weighted: bool) -> None:
    x = _inputs(3, ties)
    lp = x["lp"].clone().requires_grad_(True)
    out = composer_loss(
        LossInputs(lp, x["inf"], x["ref"], x["adv"], x["mask"], x["w"] if weighted else None),
        **({"sdpo_token_clip": 2.0, **kwargs} if kwargs.get("alpha_sdpo") else kwargs),
    )
    (grad,) = torch.autograd.grad(out.loss * 0.37, lp)  # a non-unit upstream gradient, as PRIME-RL's 1/N
    ref_lp = x["lp"].clone().requires_grad_(True)
    ref = _reference(x, ref_lp, kwargs, weighted)
    (ref_grad,) = torch.autograd.grad(ref * 0.37, ref_lp)
    torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert grad[~x["mask"]].eq(0).all()
    if ties:
        assert (grad[:20] != 0).any()  # the tied tokens carry gradient (not all masked away)
        if kwargs.get("policy_loss") == "clipped_surrogate" and not kwargs.get("alpha_sdpo"):
            # the rounding ties outside the clip range: half the unclipped side's gradient, as autograd splits it
            half = -0.5 * 0.37 * x["adv"][20:24] * torch.exp(x["lp"][20:24] - x["inf"][20:24])
            torch.testing.assert_close(
                grad[20:24], half * (x["w"][20:24] if weighted else 1), rtol=1e-12, atol=0
            )


def test_backward_is_one_multiply_not_the_formula_graph() -> None:
    """The loss is one node over trainer_logprobs: its backward dispatches a handful of aten ops
    whatever the formula (autograd through it dispatched 13)."""
    from composer_testkit.host_reads import RecordOps

    x = _inputs(0, False)
    lp = x["lp"].clone().requires_grad_(True)
    out = composer_loss(LossInputs(lp, x["inf"], x["ref"], x["adv"], x["mask"]), alpha_sdpo=1.0)
    with RecordOps() as rec:
        out.loss.backward()
    assert len(rec.ops) <= 4, rec.ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ambient_autocast_changes_nothing(dtype: torch.dtype) -> None:
    """Under ``torch.autocast`` (CPU autocast runs the same code paths as CUDA's) the loss, its gradient
    and every metric are bit-identical to the run without it: no matmul drops to half precision
    (the metrics' one matmul did, before: means over 4,096 tokens off in the third digit)."""
    n = 4096
    g = torch.Generator().manual_seed(5)
    inf = torch.rand(n, generator=g).mul(0.9).add(0.05).log()
    x = {
        "lp": inf + torch.randn(n, generator=g) * 0.3, "inf": inf, "ref": inf - 0.1,
        "adv": torch.randn(n, generator=g), "mask": torch.rand(n, generator=g) > 0.1,
    }  # fmt: skip

    def run() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        lp = x["lp"].clone().requires_grad_(True)
        out = composer_loss(LossInputs(lp, x["inf"], x["ref"], x["adv"], x["mask"]), alpha_sdpo=0.5)
        out.loss.backward()
        return out.metrics, out.loss.detach(), lp.grad

    plain = run()
    with torch.autocast("cpu", dtype=dtype):
        mixed = run()
    assert plain[0].keys() == mixed[0].keys()
    for key in plain[0]:
        assert torch.equal(plain[0][key], mixed[0][key]), key
    assert torch.equal(plain[1], mixed[1]) and torch.equal(plain[2], mixed[2])
