"""composer_core's conformance suite, run through the TorchForge loss callable ``ComposerLoss``.

``ComposerLoss`` reads *logits*; the suite hands over a ``ComposerBatch`` of log-probs. Two exact
translations are used:

1. Channel 1, sampled-token channel 2 and channel 3: every log-prob ℓ ≤ 0 becomes the 2-way logits
   [ℓ, log(1 − e^ℓ)], whose log-softmax at token 0 is ℓ with dℓ_out/dℓ = 1, so values and gradients
   reach the batch's leaves unchanged. A pair's summed log-prob c over L tokens (its length) becomes
   L tokens of c/L in an extra row, chosen and rejected rows being named by ``chosen_rows`` /
   ``rejected_rows``, exactly as a TorchForge collate would pack them; the reference side goes the
   same way through ``ref_logprobs``.
2. Full-distribution channel 2 (full, top-k, TAID, entropy-gated): the logits *are* the student
   logits, as in a real forward pass. The suite's cases for these tags carry zero advantages, so the
   tied log-probs change neither the policy value nor any gradient.

Cases that give *independent* random ``logprobs`` and ``student_logits`` (the random three-channel
ones) cannot come from one logits tensor, which is what a model produces; the report lists them as
skipped. The tied form is covered by ``test_forge_loss.py::test_equals_compose_loss_on_aligned_inputs``
and by the bit-exact mesh step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from composer_core.loss.compose import ComposerBatch
from composer_core.loss.config import flat_defaults
from composer_core.testing import CASES, check_adapter
from composer_monarch import ComposerLoss
from composer_monarch.forge_loss import FORGE_DEFAULTS
from torch import Tensor

# The conformance cases give compose_loss options; where ComposerLoss's bare defaults are TorchForge's,
# the cases mean compose_loss's own defaults.
COMPOSE_DEFAULTS = {k: flat_defaults()[k] for k in FORGE_DEFAULTS}


def _two_way(lp: Tensor) -> Tensor:
    """[..., 2] logits whose log-softmax at index 0 is ``lp`` (needs lp ≤ 0)."""
    if bool((lp.detach() > 0).any()):
        raise ValueError("a log-probability > 0 has no logits")
    return torch.stack([lp, torch.log(-torch.expm1(lp))], dim=-1)


def _widen(t: Tensor, width: int, fill: float) -> Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill, dtype=t.dtype)
    return torch.cat([t, pad], dim=1)


def _shifted(batch: ComposerBatch, c: float) -> ComposerBatch:
    fields = dict(batch.__dict__)
    for name in ("logprobs", "old_logprobs", "ref_logprobs", "inference_logprobs", "teacher_logprobs"):
        if fields[name] is not None:
            fields[name] = fields[name] + c
    return ComposerBatch(**fields)


def via_logprobs(batch: ComposerBatch, options: Mapping[str, Any]) -> Tensor:
    b, t = batch.logprobs.shape
    dtype = batch.logprobs.dtype
    # Ratio-only cases use "log-probs" > 0, which no logits produce. Channel 1 and the sampled-token
    # channel 2 depend only on differences (ℓ − ℓ_old, ℓ − ℓ_ref, ℓ − ℓ_inf, ℓ − ℓ_T), so shifting all of
    # them by one constant changes neither values nor gradients.
    top = (
        float(batch.logprobs.detach()[batch.completion_mask.bool()].max())
        if batch.completion_mask.any()
        else 0.0
    )
    shift = min(0.0, -top - 0.5)
    if shift:
        batch = _shifted(batch, shift)
    rows_lp = [batch.logprobs]
    rows_mask = [batch.completion_mask.bool()]
    rows_ref = [batch.ref_logprobs if batch.ref_logprobs is not None else torch.zeros(b, t, dtype=dtype)]
    targets: dict[str, Tensor] = {}
    n_pairs = 0
    if batch.chosen_logps is not None and batch.rejected_logps is not None:
        n_pairs = batch.chosen_logps.shape[0]
        ones = torch.ones(n_pairs, dtype=torch.long)
        for logps, ref, lengths in (
            (batch.chosen_logps, batch.ref_chosen_logps, batch.chosen_lengths),
            (batch.rejected_logps, batch.ref_rejected_logps, batch.rejected_lengths),
        ):
            lengths = ones if lengths is None else lengths.long()
            width = int(lengths.max())
            mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
            rows_lp.append((logps / lengths).unsqueeze(1).expand(-1, width))
            rows_mask.append(mask)
            ref = torch.zeros_like(logps) if ref is None else ref
            rows_ref.append((ref / lengths).unsqueeze(1).expand(-1, width))
        targets["chosen_rows"] = torch.arange(b, b + n_pairs)
        targets["rejected_rows"] = torch.arange(b + n_pairs, b + 2 * n_pairs)
    width = max(r.shape[1] for r in rows_lp)
    lp = torch.cat([_widen(r, width, -1.0) for r in rows_lp])
    rows = lp.shape[0]
    extra = rows - b

    def per_row(x: Tensor | None, fill: float) -> Tensor | None:
        if x is None:
            return None
        x = _widen(x, width, fill) if x.dim() == 2 else x
        return torch.cat([x, torch.full((extra, *x.shape[1:]), fill, dtype=x.dtype)]) if extra else x

    if batch.advantages.dim() == 2:  # per-token [B, T]
        adv = per_row(batch.advantages, 0.0)
    else:  # per-sequence [B] → TorchForge's [R, 1]
        adv = torch.cat([batch.advantages, batch.advantages.new_zeros(extra)]).unsqueeze(-1)
    targets |= {
        "response": torch.zeros(rows, width, dtype=torch.long),
        "padding_mask": torch.cat([_widen(m, width, False) for m in rows_mask]),
        "advantages": adv,
        "ref_logprobs": torch.cat([_widen(r, width, 0.0) for r in rows_ref]),
    }
    for name in ("old_logprobs", "inference_logprobs", "rollout_is_weights", "teacher_logprobs"):
        value = per_row(getattr(batch, name), 0.0 if name != "rollout_is_weights" else 1.0)
        if value is not None:
            targets[name] = value
    if batch.sdpo_mask is not None and batch.teacher_logprobs is not None:
        # (compose_loss ignores an sdpo_mask without a teacher; ComposerLoss rejects it as a user error)
        targets["sdpo_mask"] = per_row(batch.sdpo_mask.bool(), False)  # type: ignore[assignment]
    opts = {**COMPOSE_DEFAULTS, **options}
    if opts.get("loss_type") == "dr_grpo":  # widening must not change Dr. GRPO's constant L_max
        opts.setdefault("max_completion_length", t)
    loss = ComposerLoss(align=False, **opts)
    return loss(_two_way(lp), **{k: v for k, v in targets.items() if v is not None})


def via_student_logits(batch: ComposerBatch, options: Mapping[str, Any]) -> Tensor:
    assert batch.student_logits is not None and batch.teacher_logits is not None
    assert not bool(batch.advantages.any()), "tied log-probs are exact only with zero advantages"
    b, t = batch.logprobs.shape
    targets = {
        "response": torch.zeros(b, t, dtype=torch.long),
        "padding_mask": batch.completion_mask.bool(),
        "advantages": batch.advantages.reshape(b, -1),
        "teacher_logits": batch.teacher_logits,
    }
    if batch.sdpo_mask is not None:
        targets["sdpo_mask"] = batch.sdpo_mask.bool()
    return ComposerLoss(align=False, **{**COMPOSE_DEFAULTS, **options})(batch.student_logits, **targets)


def test_two_way_logits_are_exact() -> None:
    lp = torch.tensor([-3.0, -0.7, -1e-3], dtype=torch.float64, requires_grad=True)
    out = torch.log_softmax(_two_way(lp), -1)[..., 0]
    torch.testing.assert_close(out, lp, atol=1e-12, rtol=0)
    (g,) = torch.autograd.grad(out.sum(), lp)
    torch.testing.assert_close(g, torch.ones(3, dtype=torch.float64), atol=1e-9, rtol=0)
    assert math.isclose(float(torch.logsumexp(_two_way(lp.detach()), -1).abs().max()), 0.0, abs_tol=1e-12)


def test_conformance_policy_sampled_sdpo_replay() -> None:
    report = check_adapter(
        via_logprobs,
        supports={"policy", "sdpo_sampled", "dpo", "simpo", "global_normalizer"},
        atol=1e-8,
        rtol=1e-6,
    )
    assert len(report.passed) >= 12, report
    assert {"dpo/init_ln2", "simpo/closed_form", "policy/ratio_one_global_normalizer"} <= set(report.passed)


def test_conformance_full_distribution_sdpo() -> None:
    report = check_adapter(
        via_student_logits,
        supports={"sdpo_full", "sdpo_topk", "sdpo_compiled", "taid", "entropy_opd"},
        atol=1e-8,
        rtol=1e-6,
    )
    assert len(report.passed) >= 6, report
    # ComposerLoss(sdpo_compiled=True) reaches the kernel
    assert "sdpo_full/two_token_compiled" in report.passed
    # what neither translation can express: independent log-probs and student logits in one case
    untested = {c.name for c in CASES} - set(report.passed)
    mixed = {c.name for c in CASES if "sdpo_full" in c.tags and len(c.tags - {"sdpo_compiled"}) > 1}
    assert mixed <= untested
