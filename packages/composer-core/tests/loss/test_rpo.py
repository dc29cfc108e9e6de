"""RPO's NLL term on the chosen side (``rpo_alpha``, Pang et al., arXiv 2404.19733) for DPO and SimPO: closed
forms, float64 gradcheck, TRL 1.16's ``loss_type=["sigmoid", "sft"]`` expression and the option's validation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from composer_core import DPO, ComposeConfig, ComposerBatch, SimPO, dpo_loss, simpo_loss
from composer_core import compose_loss as core_compose_loss


def compose_loss(batch: ComposerBatch, config: object = None, /, **options: object):  # type: ignore[no-untyped-def]
    """core's ``compose_loss`` with channels 2 and 3 on (weight 1) unless the test sets their weights (core's
    defaults are 0)."""
    if config is None:
        options = {"alpha_sdpo": 1.0, "beta_replay": 1.0, **options}
    return core_compose_loss(batch, config, **options)  # type: ignore[arg-type]


D = torch.float64


def _t(*v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=D)


def test_dpo_nll_term_closed_form() -> None:
    # policy = reference on both sides (h = 0): ln 2 + alpha * (-(-4) / 2) = ln 2 + 0.5 * 2
    c, r = _t(-4.0), _t(-9.0)
    out = dpo_loss(c, r, c, r, options=DPO(rpo_alpha=0.5), chosen_lengths=torch.tensor([2]))
    assert out.item() == pytest.approx(math.log(2) + 1.0, abs=1e-12)
    # h = (-4 - -6) - (-9 - -8) = 3, beta 0.1: softplus(-0.3) + 0.25 * 4 / 2
    out = dpo_loss(c, r, _t(-6.0), _t(-8.0), options=DPO(rpo_alpha=0.25), chosen_lengths=torch.tensor([2]))
    assert out.item() == pytest.approx(math.log1p(math.exp(-0.3)) + 0.5, abs=1e-12)


def test_ipo_and_simpo_nll_term_closed_form() -> None:
    c, r = _t(-4.0), _t(-9.0)
    lc, lr = torch.tensor([2]), torch.tensor([3])
    simpo = simpo_loss(c, r, lc, lr, options=SimPO(beta=2.0, gamma=0.5, rpo_alpha=1.5))
    x = 2.0 * (-2.0 + 3.0) - 0.5
    assert simpo.item() == pytest.approx(math.log1p(math.exp(-x)) + 1.5 * 2.0, abs=1e-12)
    ipo = dpo_loss(
        c,
        r,
        c,
        r,
        options=DPO(loss_type="ipo", beta=0.1, rpo_alpha=2.0),
        chosen_lengths=lc,
        rejected_lengths=lr,
    )
    assert ipo.item() == pytest.approx(25.0 + 2.0 * 2.0, abs=1e-12)  # (0 - 1/(2*0.1))^2 + 2 * 4/2


def test_rpo_alpha_zero_is_the_plain_loss_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    c, r, rc, rr = (torch.randn(5, generator=g, dtype=D) for _ in range(4))
    assert torch.equal(dpo_loss(c, r, rc, rr), dpo_loss(c, r, rc, rr, options=DPO(rpo_alpha=0.0)))


def test_gradcheck_with_the_nll_term() -> None:
    g = torch.Generator().manual_seed(1)
    c, r, rc, rr = (torch.randn(4, generator=g, dtype=D).requires_grad_(True) for _ in range(4))
    lc, lr = torch.tensor([3.0, 5, 2, 7], dtype=D), torch.tensor([4.0, 1, 6, 2], dtype=D)
    for opts in (DPO(rpo_alpha=0.7), DPO(loss_type="robust", label_smoothing=0.1, rpo_alpha=0.3)):
        assert torch.autograd.gradcheck(
            lambda a, b, o=opts: dpo_loss(a, b, rc, rr, options=o, chosen_lengths=lc), (c, r)
        )
    ipo = DPO(loss_type="ipo", rpo_alpha=0.4)
    assert torch.autograd.gradcheck(
        lambda a, b: dpo_loss(a, b, rc, rr, options=ipo, chosen_lengths=lc, rejected_lengths=lr), (c, r)
    )
    assert torch.autograd.gradcheck(
        lambda a, b: simpo_loss(a, b, lc, lr, options=SimPO(rpo_alpha=0.9)), (c, r)
    )
    # the NLL's gradient on the chosen log-prob is -alpha / |y_w| / P
    c0 = c.detach().clone().requires_grad_(True)
    rc0, r0 = c0.detach(), r.detach()  # policy = reference: the DPO part's gradient is -beta/2 per pair
    dpo_loss(c0, r0, rc0, r0, options=DPO(beta=0.1, rpo_alpha=0.7), chosen_lengths=lc).backward()
    torch.testing.assert_close(c0.grad, (-0.1 / 2 - 0.7 / lc) / 4)


def _trl_rpo(per_token_c: torch.Tensor, per_token_r: torch.Tensor, ref_c, ref_r, mask_c, beta, alpha):
    """TRL 1.16 DPOTrainer._compute_loss with loss_type=["sigmoid", "sft"], loss_weights=[1, alpha], its
    expressions verbatim on the same per-token log-probs (reverse-KL f-divergence, no weighting)."""
    chosen_logps, rejected_logps = (per_token_c * mask_c).sum(1), per_token_r.sum(1)
    delta_score = (chosen_logps - ref_c) - (rejected_logps - ref_r)
    loss = (-F.logsigmoid(beta * delta_score)).mean() * 1.0
    batch_loss = -per_token_c[mask_c.bool()].mean()
    return loss + batch_loss.expand(per_token_c.size(0)).mean() * alpha, chosen_logps, rejected_logps


def test_equals_trl_sigmoid_plus_sft_for_equal_chosen_lengths() -> None:
    g = torch.Generator().manual_seed(2)
    per_c, per_r = -torch.rand(4, 6, generator=g, dtype=D) * 3, -torch.rand(4, 6, generator=g, dtype=D) * 3
    ref_c, ref_r = torch.randn(4, generator=g, dtype=D) - 9, torch.randn(4, generator=g, dtype=D) - 9
    mask = torch.ones(4, 6, dtype=D)
    trl, c, r = _trl_rpo(per_c, per_r, ref_c, ref_r, mask, 0.1, 0.5)
    ours = dpo_loss(c, r, ref_c, ref_r, options=DPO(rpo_alpha=0.5), chosen_lengths=mask.sum(1))
    torch.testing.assert_close(ours, trl, rtol=0, atol=1e-12)
    # unequal lengths: TRL's token mean weights long answers more; composer keeps the paper's per-pair mean
    mask[0, 2:] = 0
    trl, c, r = _trl_rpo(per_c, per_r, ref_c, ref_r, mask, 0.1, 0.5)
    ours = dpo_loss(c, r, ref_c, ref_r, options=DPO(rpo_alpha=0.5), chosen_lengths=mask.sum(1))
    paper = dpo_loss(c, r, ref_c, ref_r) + 0.5 * (-c / mask.sum(1)).mean()
    torch.testing.assert_close(ours, paper, rtol=0, atol=1e-12)
    assert abs(float(ours - trl)) > 1e-3


def test_compose_loss_adds_the_nll_term_to_channel_3_and_normalises_by_pairs() -> None:
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g, dtype=D)  # noqa: E731
    b = ComposerBatch(
        logprobs=r(2, 3) - 1, advantages=_t(1.0, -1.0), completion_mask=torch.ones(2, 3),
        chosen_logps=r(2) - 5, rejected_logps=r(2) - 5, ref_chosen_logps=r(2) - 5, ref_rejected_logps=r(2) - 5,
        chosen_lengths=torch.tensor([2, 4]), rejected_lengths=torch.tensor([3, 3]),
    )  # fmt: skip
    plain = compose_loss(b, beta_replay=1.0, replay_normalizer=6.0)
    rpo = compose_loss(b, beta_replay=1.0, rpo_alpha=0.5, replay_normalizer=6.0)
    assert b.chosen_logps is not None
    nll = float((-b.chosen_logps / torch.tensor([2.0, 4.0], dtype=D)).sum() / 6.0)
    assert float(rpo.replay) == pytest.approx(float(plain.replay) + 0.5 * nll, abs=1e-12)
    simpo = compose_loss(b, beta_replay=1.0, dpo_variant="simpo", rpo_alpha="0.5")
    assert ComposeConfig.from_flat(dpo_variant="simpo", rpo_alpha="0.5", beta_replay=1).replay == SimPO(
        rpo_alpha=0.5
    )
    base = compose_loss(b, beta_replay=1.0, dpo_variant="simpo")
    assert float(simpo.replay) == pytest.approx(float(base.replay) + 0.5 * nll * 6.0 / 2.0, abs=1e-12)


def test_rpo_alpha_validation() -> None:
    assert ComposeConfig.from_flat(rpo_alpha="0.5", beta_replay=1).replay == DPO(rpo_alpha=0.5)
    assert ComposeConfig.from_flat(rpo_alpha=0.5, beta_replay=1).to_flat()["rpo_alpha"] == 0.5
    with pytest.raises(ValueError, match="rpo_alpha"):
        DPO(rpo_alpha=-0.1)
    with pytest.raises(ValueError, match="rpo_alpha"):
        SimPO(rpo_alpha=-1.0)
    with pytest.raises(ValueError, match=r"`rpo_alpha`=0.5 acts only with channel 3 on \(beta_replay > 0"):
        ComposeConfig.from_flat(rpo_alpha=0.5)
    with pytest.raises(ValueError, match=r"unknown option.*dpo_rpo_alpha"):
        ComposeConfig.from_flat(dpo_rpo_alpha=0.5)
    one = torch.ones(1, dtype=D)
    with pytest.raises(ValueError, match="rpo_alpha > 0 needs `chosen_lengths`"):
        dpo_loss(one, one, one, one, options=DPO(rpo_alpha=0.5))
