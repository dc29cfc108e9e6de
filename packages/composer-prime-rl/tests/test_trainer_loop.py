"""Sum-not-mean: per-sample losses, summed by the trainer and divided by the GLOBAL rl-token
count, equal composer_core's token-level loss on the concatenated samples.

``_trainer_step`` models PRIME-RL's ``compute_loss`` (prime-rl is not installable here; the
real one is exercised by test_upstream.py when available): one ``fn(inputs, **kwargs)`` call
per packed sample; with an rl weight stream a token of weight 0 leaves the mask, and a sample
with no rl token is not called; the summed loss is divided by ``rl_scale``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from composer_core.loss.compose import ComposerBatch, compose_loss
from composer_core.loss.policy import aggregate_loss, dppo_loss
from composer_prime_rl import LossInputs, composer_loss

LENGTHS = (5, 3, 6)


def _samples(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        p_inf = torch.rand(n, generator=g, dtype=torch.float64) * 0.8 + 0.1
        p_train = (p_inf + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.6).clamp(0.05, 0.95)
        p_ref = torch.rand(n, generator=g, dtype=torch.float64) * 0.8 + 0.1
        mask = torch.rand(n, generator=g) > 0.25
        mask[0] = True
        out.append(
            {
                "lp": p_train.log(),
                "inf": p_inf.log(),
                "ref": p_ref.log(),
                "adv": torch.randn(1, generator=g, dtype=torch.float64).expand(n).clone(),  # group credit
                "mask": mask,
                "w": torch.rand(n, generator=g, dtype=torch.float64) + 0.5,
            }
        )
    return out


def _trainer_step(
    samples: list[dict[str, torch.Tensor]], kwargs: dict[str, Any], rl_scale: int, weighted: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [s["lp"].clone().requires_grad_(True) for s in samples]
    total = leaves[0].sum() * 0.0
    for s, lp in zip(samples, leaves, strict=True):
        mask, weights = s["mask"], None
        if weighted:
            mask, weights = mask & (s["w"] != 0), s["w"]
            if not bool(mask.any()):
                continue
        inputs = LossInputs(
            trainer_logprobs=lp,
            inference_logprobs=s["inf"],
            ref_logprobs=s["ref"],
            advantages=s["adv"],
            loss_mask=mask,
            loss_weights=weights,
        )
        total = total + composer_loss(inputs, **kwargs).loss
    loss = total / rl_scale
    loss.backward()
    return loss, [lp.grad for lp in leaves]


def _packed(samples: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    return torch.cat([s[key] for s in samples])[None]


def _padded(samples: list[dict[str, torch.Tensor]], key: str, fill: float | bool) -> torch.Tensor:
    width = max(LENGTHS)
    rows = [
        torch.cat([s[key], torch.full((width - len(s[key]),), fill, dtype=s[key].dtype)]) for s in samples
    ]
    return torch.stack(rows)


def _count(samples: list[dict[str, torch.Tensor]]) -> int:
    return sum(int(s["mask"].sum()) for s in samples)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("knobs", [{}, {"kl_tau": 0.05, "dppo_mask_high": 0.1, "adv_tau": 2.0}])
def test_dppo_sum_over_global_count_equals_core_on_the_concatenation(weighted, knobs) -> None:
    samples = _samples(1)
    n = _count(samples)
    loss, grads = _trainer_step(samples, knobs, n, weighted=weighted)

    lp = _packed(samples, "lp").requires_grad_(True)
    per_token, _ = dppo_loss(
        lp,
        _packed(samples, "inf"),
        _packed(samples, "adv"),
        _packed(samples, "mask"),
        mask_low=knobs.get("dppo_mask_low", 0.2),
        mask_high=knobs.get("dppo_mask_high", 0.2),
        adv_tau=knobs.get("adv_tau", 1.0),
        kl_tau=knobs.get("kl_tau", 1e-3),
    )
    if weighted:
        per_token = per_token * _packed(samples, "w")
    expected = aggregate_loss(per_token, _packed(samples, "mask"), "dapo")  # Σ over tokens / local count
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat(grads), lp.grad[0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
@pytest.mark.parametrize("clip", [2.0, None])
def test_clipped_surrogate_and_sdpo_equal_compose_loss(alpha, clip) -> None:
    samples = _samples(2)
    n = _count(samples)
    kwargs: dict[str, Any] = {"policy_loss": "clipped_surrogate", "epsilon_low": 0.2, "epsilon_high": 0.28}
    if alpha:
        kwargs.update(alpha_sdpo=alpha, sdpo_token_clip=clip)
    loss, grads = _trainer_step(samples, kwargs, n)

    lp = _padded(samples, "lp", -1.0).requires_grad_(True)
    mask = _padded(samples, "mask", False)
    batch = ComposerBatch(
        logprobs=lp,
        advantages=_padded(samples, "adv", 0.0),
        completion_mask=mask,
        old_logprobs=_padded(samples, "inf", -1.0),  # PRIME-RL's ratio is against the inference engine
        teacher_logprobs=_padded(samples, "ref", -1.0) if alpha else None,
    )
    result = compose_loss(
        batch,
        alpha_sdpo=alpha,
        beta_replay=0.0,
        loss_type="dapo",
        epsilon_low=0.2,
        epsilon_high=0.28,
        sdpo_form="sampled" if alpha else "auto",
        sdpo_token_clip=clip,
    )
    result.total.backward()
    torch.testing.assert_close(loss, result.total, rtol=1e-12, atol=1e-14)
    expected_grads = [lp.grad[i, : LENGTHS[i]] for i in range(len(samples))]
    torch.testing.assert_close(torch.cat(grads), torch.cat(expected_grads), rtol=1e-12, atol=1e-14)


def test_global_normalizer_across_micro_batches() -> None:
    """Two micro-batches (or ranks), one global count: each micro-batch's PRIME-RL loss equals
    compose_loss on that micro-batch with normalizer = sdpo_normalizer = the global count, and
    their sum equals compose_loss on everything."""
    samples = _samples(3)
    n_global = _count(samples)
    kwargs = {"policy_loss": "clipped_surrogate", "alpha_sdpo": 1.0}

    def core(part: list[dict[str, torch.Tensor]], normalizer: float | None) -> torch.Tensor:
        return compose_loss(
            ComposerBatch(
                logprobs=_packed(part, "lp"),
                advantages=_packed(part, "adv"),
                completion_mask=_packed(part, "mask"),
                old_logprobs=_packed(part, "inf"),
                teacher_logprobs=_packed(part, "ref"),
            ),
            alpha_sdpo=kwargs["alpha_sdpo"],
            loss_type="dapo",
            sdpo_form="sampled",
            normalizer=normalizer,
            sdpo_normalizer=normalizer,
        ).total

    parts = [samples[:2], samples[2:]]
    ours = [_trainer_step(p, kwargs, n_global)[0] for p in parts]
    for mine, part in zip(ours, parts, strict=True):
        torch.testing.assert_close(mine, core(part, float(n_global)), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(sum(ours), core(samples, None), rtol=1e-12, atol=1e-14)


def test_a_mean_per_sample_would_be_wrong() -> None:
    """Guard against returning a mean: samples of different lengths weigh by their token count."""
    samples = _samples(4)
    sums = [composer_loss(LossInputs(s["lp"], s["inf"], None, s["adv"], s["mask"])).loss for s in samples]
    counts = [int(s["mask"].sum()) for s in samples]
    per_token = [
        dppo_loss(s["lp"][None], s["inf"][None], s["adv"][None], s["mask"][None])[0][0][s["mask"]]
        for s in samples
    ]
    for total, tokens, count in zip(sums, per_token, counts, strict=True):
        assert total.item() == pytest.approx(tokens.sum().item(), rel=1e-12)
        assert count == 1 or not math.isclose(total.item(), tokens.mean().item(), rel_tol=1e-9)
