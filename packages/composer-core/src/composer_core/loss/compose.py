"""The composer objective: ``total = w_policy·policy + α·sdpo + β·replay``.

- channel 1, policy: GRPO-family loss (:func:`composer_core.loss.policy.policy_loss`);
- channel 2, SDPO: hinted self-distillation — the same model given a textual hint is the teacher
  (Hübotter et al., arXiv 2601.20802) — as full-vocabulary generalized JSD (logits or fused hidden states),
  top-k, or the sampled-token reverse-KL estimator, optionally wrapped by TAID or entropy-aware OPD;
- channel 3, trace replay: DPO / SimPO on pairs where teacher models' actions beat the student's.

Each channel is normalised by its own count (tokens for channels 1–2, pairs for 3), as PRIME-RL's
``compute_loss`` does, so the terms do not dilute each other. A channel whose inputs are absent from the batch
is skipped for that step (``metrics["<channel>/skipped"] = 1.0``); ``alpha_sdpo=0`` / ``beta_replay=0`` do not
compute the channel at all, so the total is bit-identical to the policy-only loss, and ``w_policy=0`` (pure
self-distillation) does not compute the policy term (``policy/skipped = 1.0``, no ``loss/policy``).
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import torch
from torch import Tensor

from composer_core.loss.config import DPO, PER_CALL, TAID, ComposeConfig, EntropyOPD, SDPOOptions, SimPO
from composer_core.loss.distill import (
    Kernel,
    _sampled_token_distill,
    fused_linear_loss,
    is_clip_weight,
    jsd_kernel,
    logits_loss,
    topk_distill,
)
from composer_core.loss.metrics import Metrics
from composer_core.loss.policy import policy_loss
from composer_core.loss.preference import dpo_loss, preference_margin, simpo_loss
from composer_core.loss.validation import (
    as_mask,
    check_float,
    check_normalizer,
    check_same_shape,
    value_checks,
)
from composer_core.loss.wrappers import entropy_opd_kernel, taid_kernel

__all__ = [
    "ComposeConfig",
    "ComposeResult",
    "ComposerBatch",
    "check_mode_options",
    "compose_loss",
    "weighted_total",
]


def weighted_total(
    policy: Tensor | None,
    sdpo: Tensor | None,
    replay: Tensor | None,
    alpha_sdpo: float,
    beta_replay: float,
    w_policy: float = 1.0,
) -> Tensor:
    """The objective: ``w_policy · policy + alpha_sdpo · sdpo + beta_replay · replay``, a skipped channel (None)
    adding nothing (``w_policy = 1`` adds ``policy`` as it is, bit for bit).

    The one place the channels are weighted: :func:`compose_loss` and every adapter's loss call it, each with its
    channels already normalised as its host normalises them (scalars, same device). At least one channel must be
    given (a step with none has no loss to build)."""
    parts = [
        (p if w == 1.0 else w * p)
        for p, w in ((policy, w_policy), (sdpo, alpha_sdpo), (replay, beta_replay))
        if p is not None
    ]
    if not parts:
        raise ValueError("weighted_total() got no channel: policy, sdpo and replay are all None.")
    return functools.reduce(operator.add, parts)


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
        rollout_is_weights: [B, T] (or [B, 1]) precomputed detached rollout IS weights.
        surrogate_mask: [B, T] or [B, 1] tokens whose surrogate counts (e.g. TRL's entropy / off-policy masks).

    Channel 2 (SDPO; any one form, plus ``sdpo_mask``):
        sdpo_mask: [B, T] tokens to distil (e.g. the targeted span, 0 for samples without a hint);
            None → ``completion_mask``.
        full form: student_logits [B, T, V] (grad), teacher_logits [B, T, V] (the hinted context; detached).
        fused form: student_hidden [B, T, Hs] (grad), teacher_hidden [B, T, Ht] (detached),
            lm_head_weight [V, Hs] (grad), lm_head_bias [V] (optional); teacher_lm_head_weight [V, Ht] /
            teacher_lm_head_bias [V] (optional, detached: a teacher with weights of its own, e.g. an EMA
            teacher or a model of another hidden size Ht; None → the student's head, which needs Ht = Hs).
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
    surrogate_mask: Tensor | None = None
    sdpo_mask: Tensor | None = None
    student_logits: Tensor | None = None
    teacher_logits: Tensor | None = None
    student_hidden: Tensor | None = None
    teacher_hidden: Tensor | None = None
    lm_head_weight: Tensor | None = None
    lm_head_bias: Tensor | None = None
    teacher_lm_head_weight: Tensor | None = None
    teacher_lm_head_bias: Tensor | None = None
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

    total: scalar to backpropagate. policy / sdpo / replay: the channel-1 / 2 / 3 losses (before w_policy / α / β;
    None when the channel was skipped: policy only with ``w_policy=0``). metrics: a :class:`~composer_core.loss.metrics.Metrics`
    mapping (keys: :data:`~composer_core.loss.metrics.METRIC_KEYS`): reading it gives floats (all keys converted
    with one host transfer, on first read), ``metrics.tensors()`` gives the detached 0-dim tensors unread.
    ``float(v)`` / ``dict(metrics)`` keep working. ``distill`` / ``preference`` are deprecated read-only aliases
    of ``sdpo`` / ``replay``.
    """

    total: Tensor
    policy: Tensor | None
    sdpo: Tensor | None = None
    replay: Tensor | None = None
    metrics: Metrics = field(default_factory=Metrics)

    @property
    def distill(self) -> Tensor | None:
        """Deprecated alias of :attr:`sdpo` (the channel-2 loss)."""
        warnings.warn(
            "ComposeResult.distill is deprecated; use ComposeResult.sdpo (channels are policy, sdpo, replay).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.sdpo

    @property
    def preference(self) -> Tensor | None:
        """Deprecated alias of :attr:`replay` (the channel-3 loss)."""
        warnings.warn(
            "ComposeResult.preference is deprecated; use ComposeResult.replay (channels are policy, sdpo, "
            "replay).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.replay


def check_mode_options(**options: object) -> None:
    """Raise ``ValueError`` for an option set to a non-default value in a mode that does not use it.

    A thin wrapper of :meth:`ComposeConfig.from_flat` (without a batch, so ``sdpo_form="auto"`` is judged when a
    batch resolves it). Adapters call it when their config is built so a user learns at construction that, e.g.,
    ``simpo_beta`` does nothing under ``dpo_variant='dpo'``. Options not given take the config's defaults.
    """
    ComposeConfig.from_flat(**{k: v for k, v in options.items() if k not in PER_CALL})  # type: ignore[arg-type]


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
    config: ComposeConfig | None = None,
    /,
    *,
    normalizer: float | Tensor | None = None,
    sdpo_normalizer: float | Tensor | None = None,
    replay_normalizer: float | Tensor | None = None,
    **options: object,
) -> ComposeResult:
    """``total = w_policy·policy + alpha_sdpo·sdpo + beta_replay·replay`` (see the module docstring).

    Two call forms: ``compose_loss(batch, config)`` with a :class:`~composer_core.loss.config.ComposeConfig`
    (build it once, reuse it every step), or the flat keyword facade ``compose_loss(batch, alpha_sdpo=...,
    dpo_variant="simpo", simpo_beta=..., sdpo_wrapper="taid", taid_t=..., ...)``, built through
    :meth:`ComposeConfig.from_flat` (cached per distinct options) with ``sdpo_form="auto"`` resolved against the
    batch before the options are judged. Defaults are the config classes' (the one place they live).

    Per call: ``normalizer`` (channel 1, :func:`composer_core.loss.policy.policy_loss`'s global count),
    ``sdpo_normalizer`` (global distilled-token count; default local count), ``replay_normalizer`` (global pair
    count; default local P). Python numbers or 0-dim tensors (a tensor is never read on the host).

    The options are the fields of :class:`~composer_core.loss.config.PolicyOptions` (channel 1, same names),
    :class:`~composer_core.loss.config.SDPOOptions` (channel 2, ``sdpo_<field>``; ``sdpo_wrapper`` ``"taid"``
    with ``taid_<field>`` or ``"entropy_opd"`` with ``entropy_opd_<field>``), and ``dpo_variant`` ``"dpo"``
    (``dpo_<field>`` of :class:`~composer_core.loss.config.DPO`) or ``"simpo"`` (``simpo_beta``, ``simpo_gamma``)
    for channel 3.

    ``check_values`` (default True): value checks (finite inputs, 0/1 masks, non-empty selections, positive
    lengths/normalisers) run fused, with ONE host sync per call; False (or ``torch.compile``) skips them (no host
    sync). Structural checks (shapes, dtypes, devices, options) always run, without reading device memory.

    Metrics (detached; see :class:`ComposeResult`): the keys of :data:`~composer_core.loss.metrics.METRIC_KEYS`.

    Raises ValueError for unknown options (with the closest name), options without effect in the resolved mode,
    contradictory options, partial channel inputs, NaN/inf, shape, device or vocabulary mismatches and empty masks
    of a channel whose inputs are present.
    """
    flags = _channel2_flags(batch)
    if config is None:
        config = ComposeConfig.from_flat(
            has_logits=flags[0], has_hidden=flags[1], has_sampled=flags[2], **options
        )
    elif options:
        raise TypeError(
            "compose_loss() takes either a ComposeConfig or flat keyword options, not both; got "
            f"{sorted(options)} beside the config (use dataclasses.replace on the config)."
        )
    elif not isinstance(config, ComposeConfig):
        raise TypeError(f"`config` must be a ComposeConfig, got {type(config).__name__}.")
    form = config.resolve(has_logits=flags[0], has_hidden=flags[1], has_sampled=flags[2])
    _check_devices(batch)
    check = config.check_values and not torch.compiler.is_compiling()
    with value_checks(check):
        return _compose(
            _upcast(batch),
            config,
            form if any(flags) else None,
            (normalizer, sdpo_normalizer, replay_normalizer),
        )


#: The per-token and per-pair float fields, upcast from bf16/fp16 to float32 once so every channel computes in
#: ``promote(dtype, float32)`` as the chunked kernels do (which upcast logits and hidden states per chunk).
_UPCAST = (
    "logprobs", "advantages", "old_logprobs", "ref_logprobs", "inference_logprobs", "rollout_is_weights",
    "teacher_logprobs", "chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps",
)  # fmt: skip


def _upcast(batch: ComposerBatch) -> ComposerBatch:
    low = {
        name: t.float()
        for name in _UPCAST
        if isinstance(t := getattr(batch, name), Tensor) and t.dtype in (torch.bfloat16, torch.float16)
    }
    return replace(batch, **low) if low else batch


def _channel2_flags(batch: ComposerBatch) -> tuple[bool, bool, bool]:
    return (
        bool(_present(batch, "student_logits", "teacher_logits")),
        bool(_present(batch, "student_hidden", "teacher_hidden", "lm_head_weight")),
        batch.teacher_logprobs is not None,
    )


def _check_devices(batch: ComposerBatch) -> None:
    """Structural: every tensor of the batch on ``logprobs``' device (no host sync)."""
    device = batch.logprobs.device if isinstance(batch.logprobs, Tensor) else None
    if device is None:  # policy_loss names the bad `logprobs`
        return
    for name in _BATCH_FIELDS:
        value = getattr(batch, name)
        if isinstance(value, Tensor) and value.device != device:
            raise ValueError(
                f"`{name}` is on {value.device} but `logprobs` is on {device}; move every batch tensor to the "
                "same device (e.g. tensor.to(logprobs.device))."
            )


def _compose(
    batch: ComposerBatch,
    cfg: ComposeConfig,
    form: str | None,
    norms: tuple[float | Tensor | None, float | Tensor | None, float | Tensor | None],
) -> ComposeResult:
    metrics: dict[str, Tensor | float] = {}
    pol: Tensor | None = None
    if cfg.w_policy == 0:  # pure self-distillation: the policy term is not computed at all
        check_float("logprobs", batch.logprobs, ndim=2)
        if batch.old_logprobs is not None:
            check_same_shape("logprobs", batch.logprobs, "old_logprobs", batch.old_logprobs)
        metrics["policy/skipped"] = 1.0
    else:
        out = policy_loss(
            batch.logprobs,
            batch.advantages,
            batch.completion_mask,
            options=cfg.policy,
            old_logprobs=batch.old_logprobs,
            ref_logprobs=batch.ref_logprobs,
            rollout_is_weights=batch.rollout_is_weights,
            inference_logprobs=batch.inference_logprobs,
            surrogate_mask=batch.surrogate_mask,
            normalizer=norms[0],
        )
        pol = out.loss
        metrics.update(out.metrics.tensors())

    # ---- channel 2 -------------------------------------------------------------------------------------
    sdpo: Tensor | None = None
    if cfg.alpha_sdpo == 0 or form is None:
        metrics["sdpo/skipped"] = 1.0
    else:
        sdpo, sdpo_metrics = _sdpo(batch, cfg.sdpo, form, norms[1])
        metrics.update(sdpo_metrics)
        metrics["sdpo/skipped"] = 0.0

    # ---- channel 3 -------------------------------------------------------------------------------------
    replay: Tensor | None = None
    ch3 = _present(batch, "chosen_logps", "rejected_logps")
    if cfg.beta_replay == 0 or not ch3:
        metrics["replay/skipped"] = 1.0
    else:
        replay, margin = _replay(batch, cfg.replay, ch3, norms[2])
        assert batch.chosen_logps is not None
        metrics["replay/pairs"] = float(batch.chosen_logps.shape[0])
        metrics["replay/accuracy"] = (margin.detach() > 0).to(torch.float64).mean()
        metrics["replay/skipped"] = 0.0
    if (
        pol is None and sdpo is None and replay is None
    ):  # w_policy=0 and no channel input here: zero, with a graph
        total = batch.logprobs.sum() * 0.0
    else:
        total = weighted_total(pol, sdpo, replay, cfg.alpha_sdpo, cfg.beta_replay, cfg.w_policy)
    if pol is not None:
        metrics["loss/policy"] = pol.detach()
    if sdpo is not None:
        metrics["loss/sdpo"] = sdpo.detach()
    if replay is not None:
        metrics["loss/replay"] = replay.detach()
    metrics["loss/total"] = total.detach()
    return ComposeResult(total=total, policy=pol, sdpo=sdpo, replay=replay, metrics=Metrics(metrics))


def _replay(
    batch: ComposerBatch, opts: DPO | SimPO, ch3: list[str], normalizer: float | Tensor | None
) -> tuple[Tensor, Tensor]:
    """Channel 3: (loss, margin)."""
    if len(ch3) != 2:
        raise ValueError(
            "trace replay needs both `chosen_logps` and `rejected_logps`; the batch has only "
            f"{ch3[0]!r}. Fill both, or leave both out to skip the channel."
        )
    assert batch.chosen_logps is not None and batch.rejected_logps is not None
    if isinstance(opts, DPO):
        if opts.rpo_alpha > 0 and batch.chosen_lengths is None:
            raise ValueError(
                "rpo_alpha > 0 needs `chosen_lengths` (the chosen side's token counts); fill them."
            )
        if batch.ref_chosen_logps is None or batch.ref_rejected_logps is None:
            raise ValueError(
                "dpo_variant='dpo' needs `ref_chosen_logps` and `ref_rejected_logps` (reference model "
                "log-probs); compute them or use dpo_variant='simpo' (reference-free)."
            )
        ipo = opts.loss_type == "ipo"
        loss = dpo_loss(
            batch.chosen_logps,
            batch.rejected_logps,
            batch.ref_chosen_logps,
            batch.ref_rejected_logps,
            options=opts,
            chosen_lengths=batch.chosen_lengths if ipo or opts.rpo_alpha > 0 else None,
            rejected_lengths=batch.rejected_lengths if ipo else None,
            normalizer=normalizer,
        )
        margin = preference_margin(
            batch.chosen_logps, batch.rejected_logps, batch.ref_chosen_logps, batch.ref_rejected_logps
        )
        return loss, margin
    if batch.chosen_lengths is None or batch.rejected_lengths is None:
        raise ValueError(
            "dpo_variant='simpo' needs `chosen_lengths` and `rejected_lengths` (SimPO is length-"
            "normalised); fill them in the batch."
        )
    loss = simpo_loss(
        batch.chosen_logps,
        batch.rejected_logps,
        batch.chosen_lengths,
        batch.rejected_lengths,
        options=opts,
        normalizer=normalizer,
    )
    lc = batch.chosen_lengths.to(batch.chosen_logps.dtype)
    lr = batch.rejected_lengths.to(batch.chosen_logps.dtype)
    return loss, batch.chosen_logps / lc - batch.rejected_logps / lr


@dataclass(frozen=True)
class _SDPOKernel:
    """Decision 1 of channel 2: the divergence. ``name``: ``"jsd"`` (generalized JSD with ``sdpo_beta``; β=1 is
    reverse KL), ``"taid"`` (TAID at interpolation ``t``), ``"entropy_opd"`` (entropy-aware OPD), ``"topk"``
    (top-k generalized JSD) or ``"sampled"`` (the sampled-token reverse-KL estimator)."""

    name: Literal["jsd", "taid", "entropy_opd", "topk", "sampled"]
    t: float | None  # TAID's interpolation of this step (None: another kernel)


#: Decision 2 of channel 2: what the kernel runs on (sampled-token log-probs, full logits, or fused hidden
#: states and the LM head). ``(batch, options, kernel, mask, normalizer, IS-clip weight) -> loss``.
_Runner = Callable[
    [ComposerBatch, SDPOOptions, _SDPOKernel, Tensor, float | Tensor | None, Tensor | None], Tensor
]


def _sdpo(
    batch: ComposerBatch, opts: SDPOOptions, form: str, normalizer: float | Tensor | None
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """Compute channel 2 in the resolved ``form``: pick the kernel, pick the runner; returns (loss, metrics)."""
    mask_src = batch.sdpo_mask if batch.sdpo_mask is not None else batch.completion_mask
    name = "sdpo_mask" if batch.sdpo_mask is not None else "completion_mask (used as sdpo_mask)"
    # with a global normaliser another micro-batch or rank holds the distilled tokens: an empty mask here is a
    # zero contribution (TRL's all-masked micro-batch); without one an empty mask is a mistake and raises
    m = as_mask(
        name,
        mask_src,
        batch.logprobs.shape,
        device=batch.logprobs.device,
        require_nonempty=normalizer is None,
    )
    metrics: dict[str, Tensor | float] = {"sdpo/tokens": m.sum().to(torch.float64)}
    kernel = _pick_kernel(opts, form)
    if kernel.t is not None:
        metrics["taid/t"] = kernel.t
    runner = _pick_runner(batch, form)
    # the IS clip of every form (TRL SDPOTrainer's distillation_is_clip): one detached weight per token
    w = is_clip_weight(batch.logprobs, batch.old_logprobs, opts.token_clip)
    if opts.loss_agg == "token_mean":
        return runner(batch, opts, kernel, m, normalizer, w), metrics
    return _seq_mean(runner, batch, opts, kernel, m, normalizer, w), metrics


def _seq_mean(
    runner: _Runner,
    batch: ComposerBatch,
    opts: SDPOOptions,
    kernel: _SDPOKernel,
    m: Tensor,
    normalizer: float | Tensor | None,
    w: Tensor | None,
) -> Tensor:
    """``Σ_rows (Σ_t loss·m / Σ_t m) / rows`` (``sdpo_loss_agg="seq_mean"``): the rows holding ``c`` distilled
    tokens form one call of the token-mean ``runner`` with normaliser ``c · rows``, one call per distinct count
    (reads the counts on the host: one sync on an accelerator)."""
    counts = m.sum(-1)
    rows: float | Tensor = float(m.shape[0]) if normalizer is None else normalizer
    sizes = [int(c) for c in torch.unique(counts[counts > 0]).tolist()]
    if not sizes:
        return runner(batch, opts, kernel, m, rows, w)
    parts = [runner(batch, opts, kernel, m & (counts == c).unsqueeze(-1), rows * c, w) for c in sizes]
    return functools.reduce(operator.add, parts)


def _pick_kernel(opts: SDPOOptions, form: str) -> _SDPOKernel:
    """The divergence the resolved ``form`` and wrapper ask for (wrappers need the full or fused form)."""
    if form in ("sampled", "topk"):
        return _SDPOKernel("sampled" if form == "sampled" else "topk", None)
    if isinstance(opts.wrapper, TAID):
        return _SDPOKernel("taid", opts.wrapper.resolve_t())
    return _SDPOKernel("entropy_opd" if isinstance(opts.wrapper, EntropyOPD) else "jsd", None)


def _pick_runner(batch: ComposerBatch, form: str) -> _Runner:
    """Sampled-token log-probs for the sampled form, logits when present (always for top-k), else the fused
    hidden-state path."""
    if form == "sampled":
        return _run_sampled
    if form == "topk" or _present(batch, "student_logits", "teacher_logits"):
        return _run_logits
    if not _present(batch, "student_hidden", "teacher_hidden", "lm_head_weight"):
        raise ValueError(
            "sdpo_form='full' needs `student_logits` + `teacher_logits`, or `student_hidden` + `teacher_hidden` "
            "+ `lm_head_weight`; the batch only has `teacher_logprobs` (use sdpo_form='sampled')."
        )
    return _run_fused


def _run_sampled(
    batch: ComposerBatch,
    opts: SDPOOptions,
    kernel: _SDPOKernel,
    m: Tensor,
    normalizer: float | Tensor | None,
    w: Tensor | None,
) -> Tensor:
    if batch.teacher_logprobs is None:
        raise ValueError(
            "sdpo_form='sampled' needs `teacher_logprobs` [B, T] (teacher log-probs of the sampled tokens)."
        )
    # logprobs / old_logprobs were validated by channel 1; the clip by the config
    check_float("teacher_logprobs", batch.teacher_logprobs)
    check_same_shape("logprobs", batch.logprobs, "teacher_logprobs", batch.teacher_logprobs)
    check_normalizer("sdpo_normalizer", normalizer)
    return _sampled_token_distill(batch.logprobs, batch.teacher_logprobs, m, w, "mean", normalizer)


def _run_logits(
    batch: ComposerBatch,
    opts: SDPOOptions,
    kernel: _SDPOKernel,
    m: Tensor,
    normalizer: float | Tensor | None,
    w: Tensor | None,
) -> Tensor:
    if kernel.name == "topk":
        _require_all(batch, "top-k", ("student_logits", "teacher_logits"))
        assert batch.student_logits is not None and batch.teacher_logits is not None and opts.topk is not None
        return topk_distill(
            batch.student_logits,
            batch.teacher_logits,
            k=opts.topk,
            beta=opts.beta,
            temperature=opts.temperature,
            mask=m,
            add_tail_bucket=opts.topk_tail,
            normalizer=normalizer,
            token_weight=w,
        )
    _require_all(batch, "full-logits", ("student_logits", "teacher_logits"))
    assert batch.student_logits is not None and batch.teacher_logits is not None
    _check_vocab_tokens(batch.student_logits, batch.logprobs, "student_logits")
    return logits_loss(
        batch.student_logits,
        batch.teacher_logits,
        _full_kernel(opts, kernel, vocab=batch.student_logits.shape[-1]),
        temperature=opts.temperature,
        mask=m,
        chunk_size=opts.chunk_size,
        reduction="mean",
        normalizer=normalizer,
        token_weight=w,
    )


def _run_fused(
    batch: ComposerBatch,
    opts: SDPOOptions,
    kernel: _SDPOKernel,
    m: Tensor,
    normalizer: float | Tensor | None,
    w: Tensor | None,
) -> Tensor:
    _require_all(batch, "fused hidden-state", ("student_hidden", "teacher_hidden", "lm_head_weight"))
    assert batch.student_hidden is not None and batch.teacher_hidden is not None
    assert batch.lm_head_weight is not None
    _check_vocab_tokens(batch.student_hidden, batch.logprobs, "student_hidden")
    return fused_linear_loss(
        batch.student_hidden,
        batch.lm_head_weight,
        batch.teacher_hidden,
        _full_kernel(opts, kernel, vocab=batch.lm_head_weight.shape[0]),
        teacher_lm_head_weight=batch.teacher_lm_head_weight,
        lm_head_bias=batch.lm_head_bias,
        teacher_lm_head_bias=batch.teacher_lm_head_bias,
        temperature=opts.temperature,
        mask=m,
        chunk_size=opts.chunk_size,
        reduction="mean",
        normalizer=normalizer,
        token_weight=w,
    )


def _full_kernel(opts: SDPOOptions, kernel: _SDPOKernel, vocab: int) -> Kernel:
    """The chunk kernel of the full forms (logits or fused hidden states) for ``kernel``; its options were checked
    by :class:`~composer_core.loss.config.SDPOOptions`."""
    if kernel.name == "taid":
        assert kernel.t is not None
        return taid_kernel(kernel.t)
    if kernel.name == "entropy_opd":
        assert isinstance(opts.wrapper, EntropyOPD)
        if opts.topk is not None and not (1 <= opts.topk <= vocab):
            raise ValueError(f"`sdpo_topk`={opts.topk!r} must be None or an int in [1, V={vocab}].")
        return entropy_opd_kernel(
            float(opts.beta), float(opts.wrapper.threshold), float(opts.wrapper.weight), opts.topk
        )
    return jsd_kernel(float(opts.beta), opts.compiled)


def _check_vocab_tokens(x: Tensor, logprobs: Tensor, name: str) -> None:
    if tuple(x.shape[:-1]) != tuple(logprobs.shape):
        raise ValueError(
            f"`{name}` has shape {tuple(x.shape)}; its leading dims must be [B, T] = {tuple(logprobs.shape)} "
            "(the same completion tokens as `logprobs`)."
        )


_BATCH_FIELDS = tuple(f.name for f in fields(ComposerBatch))
