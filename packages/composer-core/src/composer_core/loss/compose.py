"""The composer objective: ``total = w_policy·policy + α·sdpo + β·replay``.

- channel 1, policy: GRPO-family loss (:func:`composer_core.loss.policy.policy_loss`);
- channel 2, SDPO: hinted self-distillation — the same model given a textual hint is the teacher
  (Hübotter et al., arXiv 2601.20802) — as full-vocabulary generalized JSD (logits or fused hidden states),
  top-k, or the sampled-token reverse-KL estimator, optionally wrapped by TAID or entropy-aware OPD;
- channel 3, trace replay: DPO / SimPO on pairs where teacher models' actions beat the student's.

Each channel is normalised by its own count (tokens for channels 1–2, pairs for 3), as PRIME-RL's
``compute_loss`` does, so the terms do not dilute each other. A channel whose inputs are absent from the batch
is skipped for that step (``metrics["<channel>/skipped"] = 1.0``). ``alpha_sdpo=0`` / ``beta_replay=0`` (the
defaults) do not compute the channel at all, so the total is bit-identical to the policy-only loss; inputs of a
channel at weight 0 raise (they would be silently ignored). ``w_policy=0`` (pure self-distillation) does not
compute the policy term (``policy/skipped = 1.0``, no ``loss/policy``).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import replace

import torch
from torch import Tensor

from composer_core.loss.batch import _BATCH_FIELDS, ComposerBatch, ComposeResult, _present
from composer_core.loss.channels import replay_channel, sdpo_channel
from composer_core.loss.config import ComposeConfig
from composer_core.loss.metrics import Metrics
from composer_core.loss.policy import policy_loss
from composer_core.loss.validation import check_float, check_same_shape, value_checks

__all__ = [
    "ComposeConfig",
    "ComposeResult",
    "ComposerBatch",
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


#: the batch fields only channel 2 / channel 3 read, with the weight that switches the channel on
_CHANNEL_INPUTS = (
    ("alpha_sdpo", ("sdpo_mask", "student_logits", "teacher_logits", "student_hidden", "teacher_hidden",
                    "lm_head_weight", "lm_head_bias", "teacher_lm_head_weight", "teacher_lm_head_bias",
                    "teacher_logprobs")),
    ("beta_replay", ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps",
                     "chosen_lengths", "rejected_lengths")),
)  # fmt: skip


def _refuse_idle_inputs(batch: ComposerBatch, config: ComposeConfig) -> None:
    """Inputs of a channel whose weight is 0 would be silently ignored: one line naming the weight and the fix."""
    for weight, names in _CHANNEL_INPUTS:
        given = _present(batch, *names)
        if given and getattr(config, weight) == 0:
            raise ValueError(
                f"{', '.join(f'`{n}`' for n in given)} passed with {weight}=0 (the channel is off): set "
                f"{weight} > 0 to train on them, or do not pass them."
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

    Per call: ``normalizer``, ``sdpo_normalizer``, ``replay_normalizer`` (each channel's global count; None:
    the local one), Python numbers or 0-dim tensors (a tensor is never read on the host). The options and their
    help: :func:`~composer_core.loss.config.flat_option_names`, :func:`~composer_core.loss.config.option_help`.
    Metrics (detached; see :class:`ComposeResult`): the keys of :data:`~composer_core.loss.metrics.METRIC_KEYS`.

    Raises ValueError for unknown options (with the closest name), options without effect in the resolved mode,
    contradictory options, inputs of a channel at weight 0, partial channel inputs, NaN/inf, shape, device or
    vocabulary mismatches and empty masks of a channel whose inputs are present.
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
    _refuse_idle_inputs(batch, config)
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

    sdpo: Tensor | None = None
    if cfg.alpha_sdpo != 0 and form is not None:  # channel 2
        sdpo, sdpo_metrics = sdpo_channel(batch, cfg.sdpo, form, norms[1])
        metrics.update(sdpo_metrics)
    replay: Tensor | None = None
    ch3 = _present(batch, "chosen_logps", "rejected_logps")
    if cfg.beta_replay != 0 and ch3:  # channel 3
        replay, margin = replay_channel(batch, cfg.replay, ch3, norms[2])
        assert batch.chosen_logps is not None
        metrics["replay/pairs"] = float(batch.chosen_logps.shape[0])
        metrics["replay/accuracy"] = (margin.detach() > 0).to(torch.float64).mean()
    if pol is None and sdpo is None and replay is None:  # w_policy=0, nothing to distil: zero, with a graph
        total = batch.logprobs.sum() * 0.0
    else:
        total = weighted_total(pol, sdpo, replay, cfg.alpha_sdpo, cfg.beta_replay, cfg.w_policy)
    for name, loss in (("policy", pol), ("sdpo", sdpo), ("replay", replay)):
        if loss is not None:
            metrics[f"loss/{name}"] = loss.detach()
    metrics["sdpo/skipped"], metrics["replay/skipped"] = float(sdpo is None), float(replay is None)
    metrics["loss/total"] = total.detach()
    return ComposeResult(total=total, policy=pol, sdpo=sdpo, replay=replay, metrics=Metrics(metrics))
