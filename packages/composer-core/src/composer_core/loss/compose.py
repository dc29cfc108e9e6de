"""The composer objective: ``total = policy + α·distill + β·preference``.

- channel 1, policy: GRPO-family loss (:func:`composer_core.loss.policy.policy_loss`);
- channel 2, SDPO: hinted self-distillation — the same model given a textual hint is the teacher
  (Hübotter et al., arXiv 2601.20802) — as full-vocabulary generalized JSD (logits or fused hidden states),
  top-k, or the sampled-token reverse-KL estimator, optionally wrapped by TAID or entropy-aware OPD;
- channel 3, trace replay: DPO / SimPO on pairs where teacher models' actions beat the student's.

Each channel is normalised by its own count (tokens for channels 1–2, pairs for 3), as PRIME-RL's
``compute_loss`` does, so the terms do not dilute each other. A channel whose inputs are absent from the batch
is skipped for that step (``metrics["skipped/<channel>"] = 1.0``); ``alpha_sdpo=0`` / ``beta_replay=0`` do not
compute the channel at all, so the total is bit-identical to the policy-only loss.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Literal

import torch
from torch import Tensor

from composer_core.loss.distill import (
    _check_common,
    fused_linear_loss,
    generalized_jsd,
    jsd_kernel,
    sampled_token_distill,
    topk_distill,
)
from composer_core.loss.policy import KLEstimator, LossType, RolloutCorrection, policy_loss
from composer_core.loss.preference import DPOLossType, dpo_loss, preference_margin, simpo_loss
from composer_core.loss.validation import as_mask, check_choice, check_probability
from composer_core.loss.wrappers import entropy_opd_kernel, entropy_opd_loss, taid_kernel, taid_loss

__all__ = ["ComposeResult", "ComposerBatch", "check_mode_options", "compose_loss"]

SDPOForm = Literal["auto", "full", "topk", "sampled"]
SDPOWrapper = Literal["none", "taid", "entropy_opd"]


@dataclass
class ComposerBatch:
    """All tensors one ``compose_loss`` call may use. B sequences, T completion tokens, V vocabulary,
    H hidden size, P preference pairs. Masks are bool or 0/1.

    Channel 1 (policy, required):
        logprobs: [B, T] log-prob of each sampled completion token under the current policy (with grad).
        advantages: [B] or [B, T].
        completion_mask: [B, T] tokens that count for the policy loss.
        old_logprobs: [B, T] sampling-time policy log-probs (None → ratio 1).
        ref_logprobs: [B, T] reference-model log-probs (for ``kl_beta != 0``).
        inference_logprobs: [B, T] inference-engine log-probs (for ``rollout_correction``).
        rollout_is_weights: [B, T] precomputed detached rollout IS weights.

    Channel 2 (SDPO; any one form, plus ``sdpo_mask``):
        sdpo_mask: [B, T] tokens to distil (e.g. the targeted span, 0 for samples without a hint);
            None → ``completion_mask``.
        full form: student_logits [B, T, V] (grad), teacher_logits [B, T, V] (the hinted context; detached).
        fused form: student_hidden [B, T, H] (grad), teacher_hidden [B, T, H] (detached),
            lm_head_weight [V, H] (grad), lm_head_bias [V] (optional).
        sampled form: teacher_logprobs [B, T] (the student side is ``logprobs``).

    Channel 3 (trace replay):
        chosen_logps / rejected_logps: [P] summed completion log-probs under the policy (grad).
        ref_chosen_logps / ref_rejected_logps: [P] summed reference log-probs (DPO only).
        chosen_lengths / rejected_lengths: [P] completion token counts (SimPO, IPO).
    """

    logprobs: Tensor
    advantages: Tensor
    completion_mask: Tensor
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    inference_logprobs: Tensor | None = None
    rollout_is_weights: Tensor | None = None
    sdpo_mask: Tensor | None = None
    student_logits: Tensor | None = None
    teacher_logits: Tensor | None = None
    student_hidden: Tensor | None = None
    teacher_hidden: Tensor | None = None
    lm_head_weight: Tensor | None = None
    lm_head_bias: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    chosen_logps: Tensor | None = None
    rejected_logps: Tensor | None = None
    ref_chosen_logps: Tensor | None = None
    ref_rejected_logps: Tensor | None = None
    chosen_lengths: Tensor | None = None
    rejected_lengths: Tensor | None = None


@dataclass
class ComposeResult:
    """Output of :func:`compose_loss`.

    total: scalar to backpropagate. policy: channel-1 loss. distill / preference: channel 2 / 3 losses
    (before α / β), None when skipped. metrics: floats (keys in :func:`compose_loss`).
    """

    total: Tensor
    policy: Tensor
    distill: Tensor | None = None
    preference: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


_COMPOSE_OPTIONS = [
    "alpha_sdpo",
    "beta_replay",
    "loss_type",
    "epsilon_low",
    "epsilon_high",
    "delta",
    "kl_beta",
    "kl_estimator",
    "rollout_correction",
    "rollout_clip_max",
    "rollout_clip_min",
    "dppo_mask_low",
    "dppo_mask_high",
    "max_completion_length",
    "sdpo_form",
    "sdpo_beta",
    "sdpo_temperature",
    "sdpo_token_clip",
    "sdpo_topk",
    "sdpo_chunk_size",
    "sdpo_wrapper",
    "taid_t",
    "taid_schedule_step",
    "taid_total_steps",
    "taid_t_start",
    "taid_t_end",
    "entropy_opd_threshold",
    "entropy_opd_weight",
    "dpo_variant",
    "dpo_beta",
    "dpo_loss_type",
    "dpo_label_smoothing",
    "simpo_beta",
    "simpo_gamma",
    "normalizer",
    "sdpo_normalizer",
    "replay_normalizer",
]


#: Options that act in one mode only: name -> (default, does it act under these options?, what selects it).
_MODE_OPTIONS: dict[str, tuple[object, Callable[[Mapping[str, object]], bool], str]] = {
    "dpo_beta": (0.1, lambda o: o["dpo_variant"] == "dpo", "dpo_variant='dpo'"),
    "dpo_loss_type": ("sigmoid", lambda o: o["dpo_variant"] == "dpo", "dpo_variant='dpo'"),
    "dpo_label_smoothing": (0.0, lambda o: o["dpo_variant"] == "dpo", "dpo_variant='dpo'"),
    "simpo_beta": (2.0, lambda o: o["dpo_variant"] == "simpo", "dpo_variant='simpo'"),
    "simpo_gamma": (0.5, lambda o: o["dpo_variant"] == "simpo", "dpo_variant='simpo'"),
    "taid_t": (None, lambda o: o["sdpo_wrapper"] == "taid", "sdpo_wrapper='taid'"),
    "taid_schedule_step": (None, lambda o: o["sdpo_wrapper"] == "taid", "sdpo_wrapper='taid'"),
    "taid_total_steps": (None, lambda o: o["sdpo_wrapper"] == "taid", "sdpo_wrapper='taid'"),
    "taid_t_start": (0.4, lambda o: o["sdpo_wrapper"] == "taid", "sdpo_wrapper='taid'"),
    "taid_t_end": (1.0, lambda o: o["sdpo_wrapper"] == "taid", "sdpo_wrapper='taid'"),
    "entropy_opd_threshold": (
        0.8,
        lambda o: o["sdpo_wrapper"] == "entropy_opd",
        "sdpo_wrapper='entropy_opd'",
    ),
    "entropy_opd_weight": (1.0, lambda o: o["sdpo_wrapper"] == "entropy_opd", "sdpo_wrapper='entropy_opd'"),
    # the IS clip belongs to the sampled-token form ("auto" may resolve to it)
    "sdpo_token_clip": (2.0, lambda o: o["sdpo_form"] in ("auto", "sampled"), "sdpo_form='sampled'"),
    # the sampled-token form is always the reverse-KL estimator on given log-probs
    "sdpo_temperature": (1.0, lambda o: o["sdpo_form"] != "sampled", "sdpo_form='full'/'topk'"),
}
_MODE_SELECTORS: dict[str, object] = {"dpo_variant": "dpo", "sdpo_wrapper": "none", "sdpo_form": "auto"}


def check_mode_options(**options: object) -> None:
    """Raise ``ValueError`` for an option set to a non-default value in a mode that does not use it.

    ``compose_loss`` calls this; adapters call it when their config is built so a user learns at construction
    that, e.g., ``simpo_beta`` does nothing under ``dpo_variant='dpo'`` (instead of training without it).
    Options not given take ``compose_loss``'s defaults; names not listed here are not checked.
    """
    resolved: dict[str, object] = {**_MODE_SELECTORS, **options}
    unused = []
    for name, (default, acts, selector) in _MODE_OPTIONS.items():
        if name in options and options[name] != default and not acts(resolved):
            unused.append(f"`{name}`={options[name]!r} (acts only with {selector})")
    sampled_beta = options.get("sdpo_beta", 0.5)
    if resolved["sdpo_form"] == "sampled" and sampled_beta not in (0.5, 1.0):
        unused.append(
            f"`sdpo_beta`={sampled_beta!r} (sdpo_form='sampled' is always the reverse-KL estimator, beta 1)"
        )
    if unused:
        raise ValueError(
            f"option(s) set for a mode that is not selected, so they would be silently ignored: {'; '.join(unused)}. "
            "These options only apply in their mode: select it, or drop them."
        )


def _reject_unknown(unknown: dict[str, object]) -> None:
    if not unknown:
        return
    hints = []
    for key in sorted(unknown):
        close = difflib.get_close_matches(key, _COMPOSE_OPTIONS, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(
        f"compose_loss() got unknown option(s) {', '.join(hints)}; see its docstring for the options."
    )


def _resolve_taid_t(
    taid_t: float | None,
    step: int | None,
    total: int | None,
    t_start: float,
    t_end: float,
) -> float:
    if taid_t is not None and (step is not None or total is not None):
        raise ValueError(
            "pass either `taid_t` (e.g. TAIDScheduler.t) or `taid_schedule_step` + `taid_total_steps` "
            "(linear schedule), not both."
        )
    if taid_t is not None:
        return check_probability("taid_t", taid_t)
    if step is None or total is None:
        raise ValueError(
            "sdpo_wrapper='taid' needs the interpolation t: pass `taid_t` (e.g. from TAIDScheduler.t) or both "
            "`taid_schedule_step` and `taid_total_steps` for the linear t_start→t_end schedule."
        )
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"`taid_total_steps`={total!r} must be an int >= 1.")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"`taid_schedule_step`={step!r} must be an int >= 0.")
    check_probability("taid_t_start", t_start)
    check_probability("taid_t_end", t_end)
    if t_start > t_end:
        raise ValueError(f"`taid_t_start`={t_start} must not exceed `taid_t_end`={t_end}.")
    return t_start + (t_end - t_start) * min(step / total, 1.0)


def _present(batch: ComposerBatch, *names: str) -> list[str]:
    return [n for n in names if getattr(batch, n) is not None]


def _require_all(batch: ComposerBatch, form: str, names: tuple[str, ...]) -> None:
    missing = [n for n in names if getattr(batch, n) is None]
    if missing:
        raise ValueError(
            f"the {form} SDPO form needs {', '.join(names)}; the batch is missing {', '.join(missing)}. "
            "Fill them in, or leave all channel-2 fields out to skip the channel."
        )


def compose_loss(
    batch: ComposerBatch,
    *,
    alpha_sdpo: float = 1.0,
    beta_replay: float = 1.0,
    # channel 1 (policy_loss options)
    loss_type: LossType = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    kl_beta: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    rollout_correction: RolloutCorrection | None = None,
    rollout_clip_max: float | None = 3.0,
    rollout_clip_min: float | None = None,
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    max_completion_length: int | None = None,
    # channel 2
    sdpo_form: SDPOForm = "auto",
    sdpo_beta: float = 0.5,
    sdpo_temperature: float = 1.0,
    sdpo_token_clip: float | None = 2.0,
    sdpo_topk: int | None = None,
    sdpo_chunk_size: int = 1024,
    sdpo_wrapper: SDPOWrapper = "none",
    taid_t: float | None = None,
    taid_schedule_step: int | None = None,
    taid_total_steps: int | None = None,
    taid_t_start: float = 0.4,
    taid_t_end: float = 1.0,
    entropy_opd_threshold: float = 0.8,
    entropy_opd_weight: float = 1.0,
    # channel 3
    dpo_variant: Literal["dpo", "simpo"] = "dpo",
    dpo_beta: float = 0.1,
    dpo_loss_type: DPOLossType = "sigmoid",
    dpo_label_smoothing: float = 0.0,
    simpo_beta: float = 2.0,
    simpo_gamma: float = 0.5,
    # normalisers (global counts across micro-batches and ranks)
    normalizer: float | Tensor | None = None,
    sdpo_normalizer: float | Tensor | None = None,
    replay_normalizer: float | Tensor | None = None,
    **unknown: object,
) -> ComposeResult:
    """``total = policy + alpha_sdpo·distill + beta_replay·preference`` (see the module docstring).

    Channel 1 options are those of :func:`composer_core.loss.policy.policy_loss` (``normalizer`` = its global
    count). Channel 2:

    - ``sdpo_form``: ``"auto"`` picks top-k if ``sdpo_topk`` is set and logits are present, else full logits,
      else fused hidden states, else the sampled-token form; ``"full"`` (logits or fused hidden states),
      ``"topk"`` (logits + ``sdpo_topk``), ``"sampled"`` (``teacher_logprobs``; always the reverse-KL
      estimator, so ``sdpo_beta`` does not apply, ``sdpo_token_clip`` is its IS clip vs ``old_logprobs``).
    - ``sdpo_beta`` (generalized-JSD β, TRL convention: 0 forward KL, 1 reverse KL), ``sdpo_temperature``,
      ``sdpo_chunk_size``, ``sdpo_normalizer`` (global distilled-token count; default local count).
    - ``sdpo_wrapper``: ``"taid"`` (:func:`composer_core.loss.wrappers.taid_loss`; t from ``taid_t`` or the linear
      schedule ``taid_schedule_step``/``taid_total_steps``/``taid_t_start``/``taid_t_end``) or
      ``"entropy_opd"`` (base JSD with ``sdpo_beta`` + ``entropy_opd_weight``·gated FKL over the teacher
      top-``sdpo_topk`` or the full vocabulary, gate ``H(p_T) > entropy_opd_threshold``). Wrappers need the
      full or fused form.

    Channel 3: ``dpo_variant`` ``"dpo"`` (:func:`composer_core.loss.preference.dpo_loss` with ``dpo_beta``,
    ``dpo_loss_type``, ``dpo_label_smoothing``) or ``"simpo"`` (``simpo_beta``, ``simpo_gamma``);
    ``replay_normalizer`` = global pair count (default local P).

    Metrics: ``loss/total``, ``loss/policy``, ``loss/sdpo``, ``loss/replay``, ``skipped/sdpo``,
    ``skipped/replay`` (1.0 when the channel was not computed: inputs absent or weight 0),
    ``policy/clip_ratio``, ``policy/kl`` (if ``kl_beta``), ``sdpo/tokens``, ``replay/pairs``,
    ``replay/accuracy``, ``taid/t`` (TAID only), plus the policy metrics of ``policy_loss``.

    Raises ValueError for unknown options, contradictory options, partial channel inputs, NaN/inf, shape or
    vocabulary mismatches and empty masks of a channel whose inputs are present.
    """
    _reject_unknown(unknown)
    check_choice("sdpo_form", sdpo_form, ("auto", "full", "topk", "sampled"))
    check_choice("sdpo_wrapper", sdpo_wrapper, ("none", "taid", "entropy_opd"))
    check_choice("dpo_variant", dpo_variant, ("dpo", "simpo"))
    check_mode_options(
        dpo_variant=dpo_variant,
        sdpo_wrapper=sdpo_wrapper,
        sdpo_form=sdpo_form,
        dpo_beta=dpo_beta,
        dpo_loss_type=dpo_loss_type,
        dpo_label_smoothing=dpo_label_smoothing,
        simpo_beta=simpo_beta,
        simpo_gamma=simpo_gamma,
        taid_t=taid_t,
        taid_schedule_step=taid_schedule_step,
        taid_total_steps=taid_total_steps,
        taid_t_start=taid_t_start,
        taid_t_end=taid_t_end,
        entropy_opd_threshold=entropy_opd_threshold,
        entropy_opd_weight=entropy_opd_weight,
        sdpo_token_clip=sdpo_token_clip,
        sdpo_temperature=sdpo_temperature,
        sdpo_beta=sdpo_beta,
    )
    for name, w in (("alpha_sdpo", alpha_sdpo), ("beta_replay", beta_replay)):
        if not (float(w) >= 0.0) or float(w) == float("inf"):
            raise ValueError(f"`{name}`={w!r} must be a finite weight >= 0 (0 disables the channel).")

    pol = policy_loss(
        batch.logprobs,
        batch.advantages,
        batch.completion_mask,
        old_logprobs=batch.old_logprobs,
        ref_logprobs=batch.ref_logprobs,
        rollout_is_weights=batch.rollout_is_weights,
        inference_logprobs=batch.inference_logprobs,
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
        kl_beta=kl_beta,
        kl_estimator=kl_estimator,
        rollout_correction=rollout_correction,
        rollout_clip_max=rollout_clip_max,
        rollout_clip_min=rollout_clip_min,
        dppo_mask_low=dppo_mask_low,
        dppo_mask_high=dppo_mask_high,
        normalizer=normalizer,
        max_completion_length=max_completion_length,
    )
    metrics: dict[str, float] = dict(pol.metrics)
    total = pol.loss

    # ---- channel 2 -------------------------------------------------------------------------------------
    distill: Tensor | None = None
    ch2 = _present(
        batch,
        "student_logits",
        "teacher_logits",
        "student_hidden",
        "teacher_hidden",
        "lm_head_weight",
        "teacher_logprobs",
    )
    if alpha_sdpo == 0 or not ch2:
        metrics["skipped/sdpo"] = 1.0
    else:
        distill, sdpo_metrics = _sdpo(
            batch,
            form=sdpo_form,
            beta=sdpo_beta,
            temperature=sdpo_temperature,
            token_clip=sdpo_token_clip,
            topk=sdpo_topk,
            chunk_size=sdpo_chunk_size,
            wrapper=sdpo_wrapper,
            taid=(taid_t, taid_schedule_step, taid_total_steps, taid_t_start, taid_t_end),
            eopd=(entropy_opd_threshold, entropy_opd_weight),
            normalizer=sdpo_normalizer,
        )
        metrics.update(sdpo_metrics)
        metrics["skipped/sdpo"] = 0.0
        total = total + alpha_sdpo * distill

    # ---- channel 3 -------------------------------------------------------------------------------------
    preference: Tensor | None = None
    ch3 = _present(batch, "chosen_logps", "rejected_logps")
    if beta_replay == 0 or not ch3:
        metrics["skipped/replay"] = 1.0
    else:
        if len(ch3) != 2:
            raise ValueError(
                "trace replay needs both `chosen_logps` and `rejected_logps`; the batch has only "
                f"{ch3[0]!r}. Fill both, or leave both out to skip the channel."
            )
        assert batch.chosen_logps is not None and batch.rejected_logps is not None
        if dpo_variant == "dpo":
            if batch.ref_chosen_logps is None or batch.ref_rejected_logps is None:
                raise ValueError(
                    "dpo_variant='dpo' needs `ref_chosen_logps` and `ref_rejected_logps` (reference model "
                    "log-probs); compute them or use dpo_variant='simpo' (reference-free)."
                )
            ipo = dpo_loss_type == "ipo"
            preference = dpo_loss(
                batch.chosen_logps,
                batch.rejected_logps,
                batch.ref_chosen_logps,
                batch.ref_rejected_logps,
                beta=dpo_beta,
                loss_type=dpo_loss_type,
                label_smoothing=dpo_label_smoothing,
                chosen_lengths=batch.chosen_lengths if ipo else None,
                rejected_lengths=batch.rejected_lengths if ipo else None,
                normalizer=replay_normalizer,
            )
            margin = preference_margin(
                batch.chosen_logps, batch.rejected_logps, batch.ref_chosen_logps, batch.ref_rejected_logps
            )
        else:
            if batch.chosen_lengths is None or batch.rejected_lengths is None:
                raise ValueError(
                    "dpo_variant='simpo' needs `chosen_lengths` and `rejected_lengths` (SimPO is length-"
                    "normalised); fill them in the batch."
                )
            preference = simpo_loss(
                batch.chosen_logps,
                batch.rejected_logps,
                batch.chosen_lengths,
                batch.rejected_lengths,
                beta=simpo_beta,
                gamma=simpo_gamma,
                normalizer=replay_normalizer,
            )
            lc = batch.chosen_lengths.to(batch.chosen_logps.dtype)
            lr = batch.rejected_lengths.to(batch.chosen_logps.dtype)
            margin = batch.chosen_logps / lc - batch.rejected_logps / lr
        metrics["replay/pairs"] = float(batch.chosen_logps.shape[0])
        metrics["replay/accuracy"] = float((margin.detach() > 0).to(torch.float64).mean())
        metrics["skipped/replay"] = 0.0
        total = total + beta_replay * preference

    metrics["loss/policy"] = float(pol.loss.detach())
    if distill is not None:
        metrics["loss/sdpo"] = float(distill.detach())
    if preference is not None:
        metrics["loss/replay"] = float(preference.detach())
    metrics["loss/total"] = float(total.detach())
    return ComposeResult(
        total=total, policy=pol.loss, distill=distill, preference=preference, metrics=metrics
    )


def _sdpo(
    batch: ComposerBatch,
    *,
    form: str,
    beta: float,
    temperature: float,
    token_clip: float | None,
    topk: int | None,
    chunk_size: int,
    wrapper: str,
    taid: tuple[float | None, int | None, int | None, float, float],
    eopd: tuple[float, float],
    normalizer: float | Tensor | None,
) -> tuple[Tensor, dict[str, float]]:
    """Compute channel 2; returns (loss, metrics)."""
    has_logits = bool(_present(batch, "student_logits", "teacher_logits"))
    has_hidden = bool(_present(batch, "student_hidden", "teacher_hidden", "lm_head_weight"))
    has_sampled = batch.teacher_logprobs is not None
    if form == "auto":
        if has_logits:
            form = "topk" if (topk is not None and wrapper == "none") else "full"
        elif has_hidden:
            form = "full"
        else:
            form = "sampled"
    if topk is not None and form != "topk" and wrapper != "entropy_opd":
        raise ValueError(
            f"`sdpo_topk`={topk!r} only applies to the top-k form (student/teacher logits) or the entropy_opd "
            f"wrapper, but the SDPO form is {form!r} with sdpo_wrapper={wrapper!r}: drop `sdpo_topk`, or pass "
            "logits with sdpo_form='topk'."
        )
    if wrapper != "none" and form not in ("full",):
        raise ValueError(
            f"sdpo_wrapper={wrapper!r} needs full-vocabulary inputs (student/teacher logits or hidden states "
            f"+ lm_head_weight), but the SDPO form is {form!r}."
        )
    mask_src = batch.sdpo_mask if batch.sdpo_mask is not None else batch.completion_mask
    name = "sdpo_mask" if batch.sdpo_mask is not None else "completion_mask (used as sdpo_mask)"
    m = as_mask(name, mask_src, batch.logprobs.shape, device=batch.logprobs.device)
    metrics: dict[str, float] = {"sdpo/tokens": float(m.sum())}

    if form == "sampled":
        if not has_sampled:
            raise ValueError(
                "sdpo_form='sampled' needs `teacher_logprobs` [B, T] (teacher log-probs of the sampled tokens)."
            )
        assert batch.teacher_logprobs is not None
        loss = sampled_token_distill(
            batch.logprobs,
            batch.teacher_logprobs,
            m,
            old_logprobs=batch.old_logprobs,
            is_clip=token_clip,
            normalizer=normalizer,
        )
        return loss, metrics

    check_probability("sdpo_beta", beta)
    if form == "topk":
        _require_all(batch, "top-k", ("student_logits", "teacher_logits"))
        if topk is None:
            raise ValueError("sdpo_form='topk' needs `sdpo_topk` (the support size k).")
        assert batch.student_logits is not None and batch.teacher_logits is not None
        loss = topk_distill(
            batch.student_logits,
            batch.teacher_logits,
            k=topk,
            beta=beta,
            temperature=temperature,
            mask=m,
            normalizer=normalizer,
        )
        return loss, metrics

    # full vocabulary: logits or fused hidden states
    if wrapper == "taid":
        t = _resolve_taid_t(*taid)
        metrics["taid/t"] = t
    if has_logits:
        _require_all(batch, "full-logits", ("student_logits", "teacher_logits"))
        assert batch.student_logits is not None and batch.teacher_logits is not None
        _check_vocab_tokens(batch.student_logits, batch.logprobs, "student_logits")
        if wrapper == "taid":
            loss = taid_loss(
                batch.student_logits,
                batch.teacher_logits,
                metrics["taid/t"],
                temperature=temperature,
                mask=m,
                chunk_size=chunk_size,
                normalizer=normalizer,
            )
        elif wrapper == "entropy_opd":
            loss = entropy_opd_loss(
                batch.student_logits,
                batch.teacher_logits,
                threshold=eopd[0],
                fkl_weight=eopd[1],
                beta=beta,
                temperature=temperature,
                topk=topk,
                mask=m,
                chunk_size=chunk_size,
                normalizer=normalizer,
            )
        else:
            loss = generalized_jsd(
                batch.student_logits,
                batch.teacher_logits,
                beta=beta,
                temperature=temperature,
                mask=m,
                chunk_size=chunk_size,
                normalizer=normalizer,
            )
        return loss, metrics
    if not has_hidden:
        raise ValueError(
            "sdpo_form='full' needs `student_logits` + `teacher_logits`, or `student_hidden` + `teacher_hidden` "
            "+ `lm_head_weight`; the batch only has `teacher_logprobs` (use sdpo_form='sampled')."
        )
    _require_all(batch, "fused hidden-state", ("student_hidden", "teacher_hidden", "lm_head_weight"))
    assert batch.student_hidden is not None and batch.teacher_hidden is not None
    assert batch.lm_head_weight is not None
    _check_vocab_tokens(batch.student_hidden, batch.logprobs, "student_hidden")
    _check_common(temperature, chunk_size, "mean", normalizer, ("mean",))
    if wrapper == "taid":
        kernel = taid_kernel(metrics["taid/t"])
    elif wrapper == "entropy_opd":
        vocab = batch.lm_head_weight.shape[0]
        if topk is not None and not (1 <= topk <= vocab):
            raise ValueError(f"`sdpo_topk`={topk!r} must be None or an int in [1, V={vocab}].")
        kernel = entropy_opd_kernel(beta, float(eopd[0]), float(eopd[1]), topk)
    else:
        kernel = jsd_kernel(float(beta))
    loss = fused_linear_loss(
        batch.student_hidden,
        batch.lm_head_weight,
        batch.teacher_hidden,
        kernel,
        teacher_lm_head_weight=None,
        lm_head_bias=batch.lm_head_bias,
        teacher_lm_head_bias=None,
        temperature=temperature,
        mask=m,
        chunk_size=chunk_size,
        reduction="mean",
        normalizer=normalizer,
    )
    return loss, metrics


def _check_vocab_tokens(x: Tensor, logprobs: Tensor, name: str) -> None:
    if tuple(x.shape[:-1]) != tuple(logprobs.shape):
        raise ValueError(
            f"`{name}` has shape {tuple(x.shape)}; its leading dims must be [B, T] = {tuple(logprobs.shape)} "
            "(the same completion tokens as `logprobs`)."
        )


_BATCH_FIELDS = tuple(f.name for f in fields(ComposerBatch))
