"""Channels 2 and 3 of :func:`~composer_core.loss.compose.compose_loss` on a :class:`ComposerBatch`: the SDPO
divergence in its resolved form (kernel × runner: sampled-token, full logits, fused hidden states) and the trace
replay preference loss (DPO / SimPO). Each returns its channel's normalised loss, before the weight."""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from composer_core.loss.batch import ComposerBatch, _present
from composer_core.loss.config import DPO, TAID, EntropyOPD, SDPOOptions, SimPO
from composer_core.loss.distill import _sampled_token_distill, is_clip_weight, jsd_kernel, topk_distill
from composer_core.loss.engine import Kernel, fused_linear_loss, logits_loss
from composer_core.loss.preference import dpo_loss, preference_margin, simpo_loss
from composer_core.loss.validation import as_mask, check_float, check_normalizer, check_same_shape
from composer_core.loss.wrappers import entropy_opd_kernel, taid_kernel


def _require_all(batch: ComposerBatch, form: str, names: tuple[str, ...]) -> list[Tensor]:
    """The batch's ``names`` fields, all of which the ``form`` needs (raises naming the missing ones)."""
    missing = [n for n in names if getattr(batch, n) is None]
    if missing:
        raise ValueError(
            f"the {form} SDPO form needs {', '.join(names)}; the batch is missing {', '.join(missing)}. "
            "Fill them in, or leave all channel-2 fields out to skip the channel."
        )
    return [getattr(batch, n) for n in names]


def replay_channel(
    batch: ComposerBatch, opts: DPO | SimPO, ch3: list[str], normalizer: float | Tensor | None
) -> tuple[Tensor, Tensor]:
    """Channel 3: (loss, margin)."""
    if len(ch3) != 2:
        raise ValueError(
            "trace replay needs both `chosen_logps` and `rejected_logps`; the batch has only "
            f"{ch3[0]!r}. Fill both, or leave both out to skip the channel."
        )
    assert batch.chosen_logps is not None and batch.rejected_logps is not None
    if isinstance(opts, DPO):  # dpo_loss names missing lengths (ipo, rpo_alpha > 0)
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


@dataclass(frozen=True)
class _Call:
    """One channel-2 computation: batch, options, kernel, mask ``m`` [B, T], normaliser, IS-clip weight ``w``."""

    batch: ComposerBatch
    opts: SDPOOptions
    kernel: _SDPOKernel
    m: Tensor
    normalizer: float | Tensor | None
    w: Tensor | None


#: Decision 2 of channel 2: what the kernel runs on (sampled-token log-probs, full logits, or fused hidden
#: states and the LM head): ``_Call -> loss``.
_Runner = Callable[[_Call], Tensor]


def sdpo_channel(
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
    c = _Call(batch, opts, kernel, m, normalizer, w)
    return (runner(c) if opts.loss_agg == "token_mean" else _seq_mean(runner, c)), metrics


def _seq_mean(runner: _Runner, c: _Call) -> Tensor:
    """``Σ_rows (Σ_t loss·m / Σ_t m) / rows`` (``sdpo_loss_agg="seq_mean"``): the rows holding ``c`` distilled
    tokens form one call of the token-mean ``runner`` with normaliser ``c · rows``, one call per distinct count
    (reads the counts on the host: one sync on an accelerator)."""
    counts = c.m.sum(-1)
    rows: float | Tensor = float(c.m.shape[0]) if c.normalizer is None else c.normalizer
    sizes = [int(n) for n in torch.unique(counts[counts > 0]).tolist()]
    if not sizes:
        return runner(dataclasses.replace(c, normalizer=rows))
    parts = [
        runner(dataclasses.replace(c, m=c.m & (counts == n).unsqueeze(-1), normalizer=rows * n))
        for n in sizes
    ]
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


def _run_sampled(c: _Call) -> Tensor:
    if c.batch.teacher_logprobs is None:
        raise ValueError(
            "sdpo_form='sampled' needs `teacher_logprobs` [B, T] (teacher log-probs of the sampled tokens)."
        )
    # logprobs / old_logprobs were validated by channel 1; the clip by the config
    check_float("teacher_logprobs", c.batch.teacher_logprobs)
    check_same_shape("logprobs", c.batch.logprobs, "teacher_logprobs", c.batch.teacher_logprobs)
    check_normalizer("sdpo_normalizer", c.normalizer)
    return _sampled_token_distill(c.batch.logprobs, c.batch.teacher_logprobs, c.m, c.w, "mean", c.normalizer)


def _run_logits(c: _Call) -> Tensor:
    if c.kernel.name == "topk":
        student, teacher = _require_all(c.batch, "top-k", ("student_logits", "teacher_logits"))
        assert c.opts.topk is not None  # SDPOOptions.structural_errors
        return topk_distill(
            student,
            teacher,
            k=c.opts.topk,
            beta=c.opts.beta,
            temperature=c.opts.temperature,
            mask=c.m,
            add_tail_bucket=c.opts.topk_tail,
            normalizer=c.normalizer,
            token_weight=c.w,
        )
    student, teacher = _require_all(c.batch, "full-logits", ("student_logits", "teacher_logits"))
    _check_vocab_tokens(student, c.batch.logprobs, "student_logits")
    return logits_loss(
        student,
        teacher,
        _full_kernel(c.opts, c.kernel, vocab=student.shape[-1]),
        temperature=c.opts.temperature,
        mask=c.m,
        chunk_size=c.opts.chunk_size,
        reduction="mean",
        normalizer=c.normalizer,
        token_weight=c.w,
    )


def _run_fused(c: _Call) -> Tensor:
    names = ("student_hidden", "teacher_hidden", "lm_head_weight")
    hidden, teacher_hidden, head = _require_all(c.batch, "fused hidden-state", names)
    _check_vocab_tokens(hidden, c.batch.logprobs, "student_hidden")
    return fused_linear_loss(
        hidden,
        head,
        teacher_hidden,
        _full_kernel(c.opts, c.kernel, vocab=head.shape[0]),
        teacher_lm_head_weight=c.batch.teacher_lm_head_weight,
        lm_head_bias=c.batch.lm_head_bias,
        teacher_lm_head_bias=c.batch.teacher_lm_head_bias,
        temperature=c.opts.temperature,
        mask=c.m,
        chunk_size=c.opts.chunk_size,
        reduction="mean",
        normalizer=c.normalizer,
        token_weight=c.w,
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
    return jsd_kernel(opts.beta, opts.compiled)


def _check_vocab_tokens(x: Tensor, logprobs: Tensor, name: str) -> None:
    if tuple(x.shape[:-1]) != tuple(logprobs.shape):
        raise ValueError(
            f"`{name}` has shape {tuple(x.shape)}; its leading dims must be [B, T] = {tuple(logprobs.shape)} "
            "(the same completion tokens as `logprobs`)."
        )
