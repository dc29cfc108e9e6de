"""The ``composer`` policy loss (registered in verl's ``POLICY_LOSS_REGISTRY``).

    total = w_policy·policy + α·SDPO + β·replay

Channel 1 (``w_policy`` > 0, default 1; ``w_policy = 0`` is pure self-distillation and skips it): verl's PPO clipped surrogate with dual clip, computed per token by
``composer_core.loss.policy.clipped_surrogate`` and reduced by verl's own ``agg_loss`` with the actor's
``loss_agg_mode`` and ``config.global_batch_info``, so it is invariant to the micro-batch / data-parallel layout
exactly like verl's ``vanilla`` loss:

    x = clamp(ℓθ - ℓold, -20, 20),  ρ = exp(x)
    L1 = max(-ρA, -clip(ρ, 1-ε_lo, 1+ε_hi)·A)             (PPO, Schulman et al. 2017; clip-higher, DAPO)
    L  = min(L1, -c·A) where A < 0, else L1                 (dual clip, Ye et al. arXiv 1912.09729, c = clip_ratio_c)
    L  = L · w_IS                                           (verl rollout_is_weights, when given)
    policy = agg_loss(L, response_mask, loss_agg_mode, **global_batch_info)

With ``policy_delta`` set, ρ is additionally capped at δ in the unclipped branch (TRL two-sided clip).

Channel 2 (α = ``alpha_sdpo`` > 0): SDPO on the sampled tokens (Hübotter et al., arXiv 2601.20802),
``composer_core.loss.distill.sampled_token_distill``: gradient sg(ℓθ - ℓT)·∇ℓθ × min(exp(ℓθ - ℓold), clip),
averaged over the SDPO tokens of the whole mini-batch (its own global count); the ``topk`` form's per-token
divergence takes the same clipped IS weight (``composer_core.loss.distill.is_clip_weight``). Channel 3 (β = ``beta_replay`` > 0):
DPO (Rafailov et al., arXiv 2305.18290) or SimPO (Meng et al., arXiv 2405.14734) on pairs of rows,
``composer_core.loss.preference``, with the row log-prob Σ_t ℓθ·mask, averaged over the mini-batch's pairs.
Channels 2 and 3 read the batch keys of :mod:`composer_verl.batch`, which only the composer actor extension
passes in; an enabled channel without its keys raises ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch
from composer_core.loss.compose import weighted_total
from composer_core.loss.validation import checked_once

from composer_verl.batch import (
    PREF_CHOSEN,
    PREF_PAIR_ID,
    PREF_REF_LOG_PROB,
    SDPO_MASK,
    TEACHER_LOG_PROBS,
    ComposerExtras,
    active_extras,
)
from composer_verl.config import ComposerVerlConfig, current_config

LOSS_NAME = "composer"

_NO_EXTENSION = (
    "the policy loss was called without the composer actor extension, so verl passed only old_log_prob, "
    "log_prob, advantages and response_mask. Train with the composer actor extension: "
    "python -m verl.trainer.main_ppo trainer.use_v1=true trainer.v1.trainer_mode=composer_sync (as the example "
    "config composer_verl.examples/composer_grpo.yaml does), or build your workers from "
    "composer_verl.actor.ComposerActorRolloutRefWorker or wrap their loss with "
    "composer_verl.batch.with_composer_batch; or set composer.{name}=0."
)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def channel1_per_token(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    delta: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token dual-clip PPO loss (formula in the module docstring) and verl's metrics."""
    from composer_core.loss.policy import clipped_surrogate

    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (dual-clip PPO lower bound).")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    # clipped_surrogate depends on ℓθ - ℓold only; feeding the clamped log-ratio against zeros keeps
    # verl's ±20 clamp (value and its zero gradient outside the range) bit for bit.
    per_token, _ = clipped_surrogate(
        log_ratio,
        torch.zeros_like(log_ratio),
        advantages,
        epsilon_low=clip_ratio_low,
        epsilon_high=clip_ratio_high,
        delta=delta,
    )
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(per_token, dual_bound), per_token)
    mask = response_mask.to(log_prob.dtype)
    with torch.no_grad():  # verl's metric definitions: the clipped branch is the larger loss
        ratio = torch.exp(log_ratio)
        clipped_branch = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
        clipfrac = _masked_mean((clipped_branch > -advantages * ratio).to(mask.dtype), mask)
    metrics = {
        "actor/pg_clipfrac": clipfrac.item(),
        "actor/ppo_kl": _masked_mean(-log_ratio.detach(), mask).item(),
        "actor/pg_clipfrac_lower": _masked_mean(
            ((per_token.detach() > dual_bound) & negative).to(mask.dtype), mask
        ).item(),
    }
    return loss, metrics


def _require(option: str, value: float, keys: dict[str, torch.Tensor | None], how: str) -> None:
    """Raise naming the batch keys channel ``option`` reads that the micro-batch lacks."""
    missing = [k for k, v in keys.items() if v is None]
    if missing:
        raise ValueError(f"{option}={value} > 0 but the batch has no {missing}: {how}, or set {option}=0.")


def sdpo_term(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    extras: ComposerExtras,
    cfg: ComposerVerlConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Channel 2 averaged over the global count of SDPO tokens: the sampled-token SDPO term, or with
    ``sdpo_form='topk'`` the per-token top-k divergence the actor's logits hook computed (with gradient)."""
    from composer_core.loss.distill import is_clip_weight, sampled_token_distill

    topk = cfg.sdpo_form == "topk"
    if topk and (extras.topk_divergence is None or extras.sdpo_mask is None):
        raise ValueError(
            "sdpo_form='topk' but the micro-batch has no per-token top-k divergence: it is computed by the composer "
            "actor extension (trainer.v1.trainer_mode=composer_sync) from the producers' teacher prompts; "
            "use sdpo_form='sampled' elsewhere."
        )
    how = (
        f"put the teacher (hinted-context) log-probs of the sampled tokens in data.batch['{TEACHER_LOG_PROBS}'] and "
        f"the SDPO token mask in data.batch['{SDPO_MASK}'] (both (bs, response_length))"
    )
    keys = {} if topk else {TEACHER_LOG_PROBS: extras.teacher_log_probs, SDPO_MASK: extras.sdpo_mask}
    _require("alpha_sdpo", cfg.compose.alpha_sdpo, keys, how)
    assert extras.sdpo_mask is not None
    mask = extras.sdpo_mask.to(torch.bool) & response_mask.to(torch.bool)
    local = int(mask.sum().item())
    normalizer = extras.normalizer(extras.global_sdpo_tokens, local)
    metrics = {"composer/sdpo/tokens": float(local)}
    if topk and extras.topk_divergence is not None:
        per_token = extras.topk_divergence.to(log_prob.dtype)
        # SDPO's IS clip on the top-k form too (core's one weight; the sampled form applies it inside core)
        w = is_clip_weight(log_prob, old_log_prob, cfg.compose.sdpo.token_clip)
        per_token = per_token if w is None else per_token * w
        if local == 0:  # this micro-batch holds no hinted tokens: it contributes nothing, with a graph
            return (log_prob * 0.0).sum() + (per_token * 0.0).sum(), metrics
        return torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / normalizer, metrics
    assert extras.teacher_log_probs is not None
    for name, t in ((TEACHER_LOG_PROBS, extras.teacher_log_probs), (SDPO_MASK, extras.sdpo_mask)):
        if t.shape != log_prob.shape:
            raise ValueError(
                f"data.batch['{name}'] has shape {tuple(t.shape)}, expected {tuple(log_prob.shape)}."
            )
    if local == 0:
        return (log_prob * 0.0).sum(), metrics
    loss = sampled_token_distill(
        log_prob,
        extras.teacher_log_probs.to(log_prob.dtype),
        mask,
        old_logprobs=old_log_prob,
        is_clip=cfg.compose.sdpo.token_clip,
        reduction="mean",
        normalizer=normalizer,
    )
    return loss, metrics


def _pair_rows(pair_id: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices (chosen, rejected) of every pair in the micro-batch, by ascending pair id, on the columns'
    device; each pair must be complete. One read of the two columns to the host (a sync on a GPU), whatever
    the number of pairs."""
    columns = torch.stack([pair_id.reshape(-1).long(), chosen.reshape(-1).bool().long()])
    ids, flags = columns.tolist()
    members: dict[int, tuple[list[int], list[int]]] = {}
    for row, (pid, is_chosen) in enumerate(zip(ids, flags, strict=True)):
        if pid >= 0:
            members.setdefault(pid, ([], []))[0 if is_chosen else 1].append(row)
    chosen_rows: list[int] = []
    rejected_rows: list[int] = []
    for pid in sorted(members):
        c, r = members[pid]
        if len(c) != 1 or len(r) != 1:
            raise ValueError(
                f"{PREF_PAIR_ID}={pid}: this micro-batch holds {len(c)} chosen and {len(r)} rejected rows, need "
                "exactly 1 of each. Keep both rows of a pair adjacent and in one micro-batch "
                "(actor_rollout_ref.actor.shuffle=False, actor_rollout_ref.actor.use_dynamic_bsz=False, an even "
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu)."
            )
        chosen_rows.append(c[0])
        rejected_rows.append(r[0])
    index = torch.tensor([chosen_rows, rejected_rows], dtype=torch.long, device=columns.device)
    return index[0], index[1]


def replay_term(
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    extras: ComposerExtras,
    cfg: ComposerVerlConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Channel 3: DPO / SimPO over the pairs of the micro-batch, averaged over the global pair count."""
    from composer_core.loss.config import SimPO
    from composer_core.loss.preference import dpo_loss, simpo_loss

    how = (
        f"mark preference pairs with data.batch['{PREF_PAIR_ID}'] (bs,) int64 (-1 = none) and "
        f"data.batch['{PREF_CHOSEN}'] (bs,) 0/1"
    )
    keys = {PREF_PAIR_ID: extras.pref_pair_id, PREF_CHOSEN: extras.pref_chosen}
    _require("beta_replay", cfg.compose.beta_replay, keys, how)
    assert extras.pref_pair_id is not None and extras.pref_chosen is not None
    rows = log_prob.shape[0]
    for name, t in (
        (PREF_PAIR_ID, extras.pref_pair_id),
        (PREF_CHOSEN, extras.pref_chosen),
        (PREF_REF_LOG_PROB, extras.pref_ref_log_prob),
    ):
        # one value per row: a (bs, L) tensor here (e.g. per-token reference log-probs) would otherwise be
        # flattened and indexed by row, silently pairing the wrong numbers
        if t is not None and tuple(t.shape) not in ((rows,), (rows, 1)):
            raise ValueError(
                f"data.batch['{name}'] has shape {tuple(t.shape)}, expected ({rows},): one value per row"
                + (" (the row's summed reference log-prob)" if name == PREF_REF_LOG_PROB else "")
                + "."
            )
    ci, ri = _pair_rows(extras.pref_pair_id, extras.pref_chosen)
    if ci.numel() == 0:
        return (log_prob * 0.0).sum(), {"composer/replay/pairs": 0.0}
    mask = response_mask.to(log_prob.dtype)
    seq_logp = (log_prob * mask).sum(-1)
    lengths = mask.sum(-1)
    normalizer = extras.normalizer(extras.global_pref_pairs, ci.numel())
    replay = cfg.compose.replay  # composer_core's typed DPO(...) | SimPO(...), built once with the config
    if isinstance(replay, SimPO):
        loss = simpo_loss(
            seq_logp[ci],
            seq_logp[ri],
            lengths[ci],
            lengths[ri],
            options=replay,
            reduction="mean",
            normalizer=normalizer,
        )
    else:
        if extras.pref_ref_log_prob is not None:
            ref_seq = extras.pref_ref_log_prob.reshape(-1).to(log_prob.dtype)
        elif extras.ref_log_prob is not None:
            ref_seq = (extras.ref_log_prob.to(log_prob.dtype) * mask).sum(-1)
        else:
            raise ValueError(
                f"dpo_variant='dpo' needs reference log-probs: give data.batch['{PREF_REF_LOG_PROB}'] (bs,) or run "
                "verl's reference model (ref_log_prob), or use dpo_variant='simpo'."
            )
        ipo = replay.loss_type == "ipo"  # IPO averages per token: it takes both lengths, RPO's NLL the chosen
        loss = dpo_loss(
            seq_logp[ci],
            seq_logp[ri],
            ref_seq[ci],
            ref_seq[ri],
            options=replay,
            chosen_lengths=lengths[ci] if ipo or replay.rpo_alpha > 0 else None,
            rejected_lengths=lengths[ri] if ipo else None,
            reduction="mean",
            normalizer=normalizer,
        )
    return loss, {"composer/replay/pairs": float(ci.numel())}


# every value check the channels' core losses make joins one fused check: one host read (a sync on a GPU) for
# all of them, where each direct call would read once per checked tensor
@checked_once
def compute_policy_loss_composer(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy-loss contract: ``(scalar loss, metrics)``; tensors are ``(bs, response_length)``.

    ``config`` is verl's ``ActorConfig`` (``clip_ratio``, ``clip_ratio_low/high``, ``clip_ratio_c``,
    ``global_batch_info``); composer's own options come from the ``composer:`` section (:func:`composer_verl.config.current_config`).
    """
    if config is None:
        raise ValueError(
            "the composer policy loss needs verl's ActorConfig as `config` (clip ratios, batch info)."
        )
    cfg = current_config()
    w = cfg.compose  # the channel weights
    policy: torch.Tensor | None = None
    metrics: dict[str, Any] = {"composer/policy/skipped": 1.0}  # w_policy=0: pure self-distillation
    if w.w_policy != 0:
        policy, metrics = _policy_term(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, cfg
        )
    extras = active_extras()
    for option, weight in (("alpha_sdpo", w.alpha_sdpo), ("beta_replay", w.beta_replay)):
        if weight > 0 and extras is None:
            raise ValueError(f"{option} > 0 but " + _NO_EXTENSION.format(name=option))
    sdpo = replay = None
    if w.alpha_sdpo > 0:
        assert extras is not None
        sdpo, m = sdpo_term(log_prob, old_log_prob, response_mask, extras, cfg)
        metrics.update(m)
        metrics["composer/loss/sdpo"] = sdpo.detach().item()
    if w.beta_replay > 0:
        assert extras is not None
        replay, m = replay_term(log_prob, response_mask, extras, cfg)
        metrics.update(m)
        metrics["composer/loss/replay"] = replay.detach().item()
    return weighted_total(policy, sdpo, replay, w.alpha_sdpo, w.beta_replay, w.w_policy), metrics


def _policy_term(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: torch.Tensor | None,
    cfg: ComposerVerlConfig,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Channel 1: the dual-clip surrogate reduced by verl's ``agg_loss`` (module docstring), and its metrics."""
    from verl.trainer.ppo.core_algos import agg_loss

    clip_ratio = config.get("clip_ratio", 0.2)
    clip_low = config.get("clip_ratio_low", None)
    clip_high = config.get("clip_ratio_high", None)
    per_token, metrics = channel1_per_token(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio if clip_low is None else clip_low,
        clip_ratio_high=clip_ratio if clip_high is None else clip_high,
        clip_ratio_c=config.get("clip_ratio_c", 3.0),
        delta=cfg.policy_delta,
    )
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights
    batch_info = dict(config.get("global_batch_info", None) or {})
    policy = agg_loss(loss_mat=per_token, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch_info)
    out: dict[str, Any] = {**metrics, "composer/loss/policy": policy.detach().item()}
    return policy, out
