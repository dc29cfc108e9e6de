"""composer_core's conformance suite through the verl adapter's loss path.

``compute`` translates a ``ComposerBatch`` into what verl hands the registered ``composer`` policy loss
(``(bs, L)`` token tensors, an ``ActorConfig`` with ``global_batch_info``) plus the composer batch keys
the actor extension passes in, and returns the adapter's total. Translation, stated once:

* preference pairs become rows of the same ``log_prob`` tensor (that is how they reach verl's loss: as
  sequences of the batch); a pair member of summed log-prob ``s`` and length ``n`` is ``n`` tokens of
  ``s/n`` (so ``Σ_t = s`` and the row length is ``n``), with advantage 0;
* compose_loss's ``loss_type`` and normalisers map to verl's ``loss_agg_mode`` and ``global_batch_info``
  (dapo/bnpo -> token-mean with ``batch_num_tokens``; grpo -> seq-mean-token-mean with
  ``global_batch_size``; dr_grpo -> seq-mean-token-sum-norm with ``loss_scale_factor``);
* compose_loss has no dual clip, so ``clip_ratio_c`` is set out of reach (1e30);
* ``kl_beta`` is verl's ``use_kl_loss`` term, added the way verl's ``ppo_loss`` adds it (``kl_penalty`` +
  ``agg_loss`` with the same mode and batch info);
* a channel whose inputs are absent is switched off (α or β = 0), as a verl user would configure it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import composer_verl.plugin  # noqa: F401
import pytest
import torch
from composer_core.loss.compose import ComposerBatch
from composer_core.testing import cases_for, check_adapter
from composer_verl.batch import ComposerExtras, using_extras
from composer_verl.config import configure
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from verl.workers.config import ActorConfig

SUPPORTS = {"policy", "sdpo_sampled", "dpo", "simpo", "global_normalizer"}
VERL_KL = {"k1": "k1", "k2": "k2", "k3": "low_var_kl"}
KNOWN = {
    "loss_type", "epsilon_low", "epsilon_high", "delta", "kl_beta", "kl_estimator", "normalizer",
    "max_completion_length", "alpha_sdpo", "beta_replay", "sdpo_form", "sdpo_token_clip", "sdpo_normalizer",
    "dpo_variant", "dpo_beta", "dpo_loss_type", "dpo_label_smoothing", "simpo_beta", "simpo_gamma",
    "replay_normalizer",
}  # fmt: skip


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _agg(options: Mapping[str, Any], b: int, t: int, tokens: int) -> tuple[str, dict[str, Any]]:
    loss_type = options.get("loss_type", "dapo")
    norm = options.get("normalizer")
    if loss_type in ("dapo", "bnpo"):
        return "token-mean", {"dp_size": 1, "batch_num_tokens": norm if norm is not None else tokens}
    if loss_type == "grpo":
        return "seq-mean-token-mean", {"dp_size": 1, "global_batch_size": norm if norm is not None else b}
    if loss_type == "dr_grpo":
        if norm is not None:
            return "seq-mean-token-sum-norm", {
                "dp_size": 1,
                "global_batch_size": norm,
                "loss_scale_factor": 1,
            }
        l_max = options.get("max_completion_length") or t
        return "seq-mean-token-sum-norm", {"dp_size": 1, "global_batch_size": b, "loss_scale_factor": l_max}
    raise ValueError(f"loss_type {loss_type!r} has no verl loss_agg_mode")


def compute(batch: ComposerBatch, options: Mapping[str, Any]) -> torch.Tensor:
    unknown = set(options) - KNOWN
    assert not unknown, f"conformance options the verl translation does not map: {unknown}"
    b, t = batch.logprobs.shape
    has_pairs = batch.chosen_logps is not None
    if batch.student_logits is not None or batch.student_hidden is not None:
        raise AssertionError("full-logit SDPO is not part of SUPPORTS")
    alpha = options.get("alpha_sdpo", 1.0) if batch.teacher_logprobs is not None else 0.0
    beta = options.get("beta_replay", 1.0) if has_pairs else 0.0
    if alpha:
        assert options.get("sdpo_form", "auto") in ("auto", "sampled")
    configure(
        {
            "alpha_sdpo": alpha,
            "beta_replay": beta,
            "policy_delta": options.get("delta"),
            "sdpo_token_clip": options.get("sdpo_token_clip", 2.0),
            "dpo_variant": options.get("dpo_variant", "dpo"),
            "dpo_beta": options.get("dpo_beta", 0.1),
            "dpo_loss_type": options.get("dpo_loss_type", "sigmoid"),
            "dpo_label_smoothing": options.get("dpo_label_smoothing", 0.0),
            "simpo_beta": options.get("simpo_beta", 2.0),
            "simpo_gamma": options.get("simpo_gamma", 0.5),
        }
    )
    mask = batch.completion_mask.bool()
    rows_lp, rows_mask = [batch.logprobs], [mask]
    adv = batch.advantages if batch.advantages.dim() == 2 else batch.advantages[:, None].expand(b, t)
    rows_adv = [adv]
    pair_id = [torch.full((b,), -1)]
    chosen = [torch.zeros(b, dtype=torch.long)]
    ref_seq = [torch.zeros(b, dtype=batch.logprobs.dtype)]
    width = t
    if has_pairs:
        p = batch.chosen_logps.shape[0]
        ones = torch.ones(p, dtype=torch.long)
        lc = batch.chosen_lengths if batch.chosen_lengths is not None else ones
        lr = batch.rejected_lengths if batch.rejected_lengths is not None else ones
        width = max(t, int(lc.max()), int(lr.max()))
        for i in range(p):
            for logp, n, ref, is_chosen in (
                (batch.chosen_logps[i], int(lc[i]), batch.ref_chosen_logps, 1),
                (batch.rejected_logps[i], int(lr[i]), batch.ref_rejected_logps, 0),
            ):
                rows_lp.append(_pad((logp / n).expand(1, n), width))
                rows_mask.append(_pad(torch.ones(1, n, dtype=torch.bool), width))
                rows_adv.append(torch.zeros(1, width, dtype=batch.logprobs.dtype))
                pair_id.append(torch.tensor([i]))
                chosen.append(torch.tensor([is_chosen]))
                ref_seq.append(
                    (ref[i] if ref is not None else torch.zeros(())).reshape(1).to(batch.logprobs.dtype)
                )
    log_prob = torch.cat([_pad(x, width) for x in rows_lp])
    response_mask = torch.cat([_pad(x, width) for x in rows_mask])
    advantages = torch.cat([_pad(x, width) for x in rows_adv])
    n_rows = log_prob.shape[0]
    old = batch.old_logprobs if batch.old_logprobs is not None else batch.logprobs.detach()
    old_log_prob = torch.cat([_pad(old, width), log_prob.detach()[b:]])

    extras = ComposerExtras(
        pref_pair_id=torch.cat(pair_id),
        pref_chosen=torch.cat(chosen),
        pref_ref_log_prob=torch.cat(ref_seq),
        global_pref_pairs=options.get("replay_normalizer"),
    )
    if batch.teacher_logprobs is not None:
        sdpo = batch.sdpo_mask if batch.sdpo_mask is not None else batch.completion_mask
        filler = torch.zeros(n_rows - b, width, dtype=batch.teacher_logprobs.dtype)
        extras.teacher_log_probs = torch.cat([_pad(batch.teacher_logprobs, width), filler])
        extras.sdpo_mask = torch.cat(
            [_pad(sdpo.bool(), width), torch.zeros(n_rows - b, width, dtype=torch.bool)]
        )
        extras.global_sdpo_tokens = options.get("sdpo_normalizer")

    mode, info = _agg(options, b, t, int(mask.sum()))
    eps_lo = options.get("epsilon_low", 0.2)
    eps_hi = options.get("epsilon_high")
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=eps_lo,
        clip_ratio_low=eps_lo,
        clip_ratio_high=eps_lo if eps_hi is None else eps_hi,
        clip_ratio_c=1e30,
        loss_agg_mode=mode,
    )
    config.global_batch_info.update(info)
    with using_extras(extras):
        total, _ = get_policy_loss_fn("composer")(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=advantages,
            response_mask=response_mask,
            loss_agg_mode=mode,
            config=config,
        )
    kl_beta = options.get("kl_beta", 0.0)
    if kl_beta:
        ref = _pad(batch.ref_logprobs, width)
        kld = kl_penalty(log_prob[:b], ref, VERL_KL[options.get("kl_estimator", "k3")])
        total = total + kl_beta * agg_loss(kld, response_mask[:b], mode, **info)
    return total


def test_cases_cover_every_channel_the_adapter_supports() -> None:
    names = {c.name.split("/")[0] for c in cases_for(SUPPORTS)}
    assert {"policy", "sdpo_sampled", "dpo", "simpo"} <= names


def test_conformance_suite_passes_through_the_verl_loss() -> None:
    report = check_adapter(compute, supports=SUPPORTS, atol=1e-9, rtol=1e-7)
    assert len(report.passed) == len(cases_for(SUPPORTS)) >= 10
    configure(None)


def test_conformance_detects_a_wrong_adapter() -> None:
    """The suite is not vacuous here: a 0.1 % error in the adapter's total fails it."""

    def off_by_a_little(batch: ComposerBatch, options: Mapping[str, Any]) -> torch.Tensor:
        return compute(batch, options) * 1.001

    with pytest.raises(AssertionError, match="conformance failure"):
        check_adapter(off_by_a_little, supports={"policy"})
    configure(None)
