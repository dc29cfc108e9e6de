"""The per-channel option classes of :class:`~composer_core.loss.config.ComposeConfig`: each option's type,
default, check and help text (``metadata["help"]``, read by :func:`~composer_core.loss.config.option_help`),
declared once, beside its field.

An option that acts only under another value of a sibling (``rollout_clip_max`` without ``rollout_correction``,
``kl_estimator`` with ``kl_beta=0``, ``sdpo_topk_tail`` outside the top-k form, ...) is refused by
``__post_init__`` (see each class's ``unused``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from composer_core.loss.chunking import check_chunk_size
from composer_core.loss.surrogates import IS_LEVELS, ISLevel
from composer_core.loss.validation import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_probability,
)

__all__ = [
    "CLIP_LOSS_TYPES",
    "DPO",
    "LOSS_TYPES",
    "ROLLOUT_MODES",
    "TAID",
    "EntropyOPD",
    "PolicyOptions",
    "SDPOOptions",
    "SimPO",
    "check_clip_args",
    "check_rollout_clip",
]

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo"]
KLEstimator = Literal["k1", "k2", "k3"]
RolloutMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
RolloutCorrection = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "dppo_mask"]
DPOLossType = Literal["sigmoid", "robust", "ipo"]
SDPOForm = Literal["auto", "full", "topk", "sampled"]
ResolvedForm = Literal["full", "topk", "sampled"]
SDPOWrapper = Literal["none", "taid", "entropy_opd"]
SDPOLossAgg = Literal["token_mean", "seq_mean"]
DPOVariant = Literal["dpo", "simpo"]

LOSS_TYPES: tuple[str, ...] = get_args(LossType)
CLIP_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the PPO clip surrogate
ROLLOUT_MODES: tuple[str, ...] = get_args(RolloutMode)

_HEADER = "option(s) set for a mode that is not selected, so they would be silently ignored: "
_FOOTER = ". These options only apply in their mode: select it, or drop them."


def _raise_unused(unused: list[str]) -> None:
    if unused:
        raise ValueError(_HEADER + "; ".join(unused) + _FOOTER)


def _opt(default: Any, help: str) -> Any:
    """A dataclass field with its default and its help text (``--help`` of every adapter)."""
    return field(default=default, metadata={"help": help})


def _default(klass: type, name: str) -> object:
    f = next(f for f in dataclasses.fields(klass) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING
    return f.default_factory()


def _non_default(obj: object, name: str) -> bool:
    return bool(getattr(obj, name) != _default(type(obj), name))


def check_clip_args(
    epsilon_low: float, epsilon_high: float | None, delta: float | None
) -> tuple[float, float]:
    """Check the clip options of :class:`PolicyOptions` / :func:`~composer_core.loss.policy.clipped_surrogate` and
    return ``(ε_lo, ε_hi)``: ``0 ≤ ε_lo < 1``, ``ε_hi ≥ 0`` (None → ε_lo), ``δ > 1 + ε_hi`` when given. Raises
    ``ValueError`` naming the option."""
    eps_lo = check_probability("epsilon_low", epsilon_low, high_open=True)
    eps_hi = eps_lo if epsilon_high is None else float(epsilon_high)
    if not (eps_hi >= 0.0):
        raise ValueError(f"`epsilon_high`={epsilon_high!r} must be >= 0 (None = epsilon_low).")
    if delta is not None and not (float(delta) > 1.0 + eps_hi):
        raise ValueError(
            f"`delta`={delta!r} must exceed 1 + epsilon_high = {1.0 + eps_hi} (it caps the unclipped ratio); "
            "pass delta=None to disable the two-sided clip."
        )
    return eps_lo, eps_hi


def check_rollout_clip(clip_min: float | None, clip_max: float | None, *, prefix: str = "") -> None:
    """Bounds of the rollout IS weights (None = unbounded): ``clip_max > 0``, ``0 ≤ clip_min ≤ clip_max``; the
    message names them ``<prefix>clip_min`` / ``<prefix>clip_max``."""
    if clip_max is not None:
        check_number(f"{prefix}clip_max", clip_max, low=0.0, strict=True)
    if clip_min is not None:
        check_number(f"{prefix}clip_min", clip_min, low=0.0)
    if clip_min is not None and clip_max is not None and clip_min > clip_max:
        raise ValueError(f"`{prefix}clip_min`={clip_min} exceeds `{prefix}clip_max`={clip_max}.")


# ----------------------------------------------------------------------------------------------- channel 1
@dataclass(frozen=True)
class PolicyOptions:
    """Channel 1: the options of :func:`composer_core.loss.policy.policy_loss`, checked here once (ranges and
    combinations; ``policy_loss`` checks only its tensors per call). Flat names: the same field names. The
    surrogates: :func:`~composer_core.loss.policy.aggregate_loss`, :func:`~composer_core.loss.policy.kl_penalty`,
    :func:`~composer_core.loss.policy.rollout_correction_weights`, :func:`~composer_core.loss.policy.dppo_mask`.

    An option outside its mode (see :meth:`unused`) at a non-default value raises ``ValueError``.
    """

    loss_type: LossType = _opt("dapo", "the policy surrogate and its token aggregation.")
    epsilon_low: float = _opt(0.2, "lower clip range of the ratio, 0 <= epsilon_low < 1.")
    epsilon_high: float | None = _opt(None, "upper clip range, >= 0 (None: epsilon_low; CISPO's ratio cap).")
    delta: float | None = _opt(None, "INTELLECT-2 cap of the unclipped ratio, > 1 + epsilon_high.")
    kl_beta: float = _opt(0.0, "coefficient of the KL to the reference model (0: no KL).")
    kl_estimator: KLEstimator = _opt("k3", "per-token KL estimator (kl_beta != 0).")
    kl_bias_correction: bool = _opt(False, "the KL times the ratio exp(logp - old_logp) (TRL's default).")
    rollout_correction: RolloutCorrection | None = _opt(None, "rollout IS correction (None: off).")
    rollout_clip_max: float | None = _opt(3.0, "upper bound (> 0) of the rollout IS weights.")
    rollout_clip_min: float | None = _opt(None, "lower bound (>= 0) of the rollout IS weights.")
    dppo_mask_low: float = _opt(0.2, "lower bound in [0, 1] of rollout_correction='dppo_mask'.")
    dppo_mask_high: float = _opt(0.2, "upper bound in [0, 1] of rollout_correction='dppo_mask'.")
    max_completion_length: int | None = _opt(None, "Dr. GRPO's L_max, an int >= 1 (None: T).")
    importance_sampling_level: ISLevel = _opt("token", "'token' or 'sequence' (GSPO) ratios.")
    sapo_temperature_pos: float = _opt(1.0, "SAPO's temperature tau for advantages > 0 (loss_type='sapo').")
    sapo_temperature_neg: float = _opt(1.05, "SAPO's temperature tau for advantages <= 0 (loss_type='sapo').")
    vespo_k_pos: float = _opt(2.0, "VESPO's gamma shape k for advantages >= 0 (loss_type='vespo').")
    vespo_lambda_pos: float = _opt(3.0, "VESPO's gamma rate lambda for advantages >= 0 (loss_type='vespo').")
    vespo_k_neg: float = _opt(3.0, "VESPO's gamma shape k for advantages < 0 (loss_type='vespo').")
    vespo_lambda_neg: float = _opt(2.0, "VESPO's gamma rate lambda for advantages < 0 (loss_type='vespo').")

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("importance_sampling_level", self.importance_sampling_level, IS_LEVELS)
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            check_number(name, getattr(self, name), low=0.0, strict=True)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            check_number(name, getattr(self, name))
        check_choice("kl_estimator", self.kl_estimator, ("k1", "k2", "k3"))
        check_choice("rollout_correction", self.rollout_correction, (None, *ROLLOUT_MODES, "dppo_mask"))
        check_number("kl_beta", self.kl_beta, low=0.0)
        check_bool("kl_bias_correction", self.kl_bias_correction)
        _raise_unused(self.unused())
        check_clip_args(self.epsilon_low, self.epsilon_high, self.delta)
        if self.rollout_correction == "dppo_mask":
            check_probability("dppo_mask_low", self.dppo_mask_low)
            check_probability("dppo_mask_high", self.dppo_mask_high)
        elif self.rollout_correction is not None:
            check_rollout_clip(self.rollout_clip_min, self.rollout_clip_max, prefix="rollout_")
        if self.max_completion_length is not None:
            check_int("max_completion_length", self.max_completion_length, low=1)

    @property
    def epsilons(self) -> tuple[float, float]:
        """``(ε_lo, ε_hi)``, ``ε_hi = ε_lo`` when ``epsilon_high`` is None."""
        return check_clip_args(self.epsilon_low, self.epsilon_high, self.delta)

    def unused(self) -> list[str]:
        """Messages for options set (non-default) in a mode that does not read them."""
        modes = "/".join(map(repr, ROLLOUT_MODES))
        rules = (
            ("rollout_clip_max rollout_clip_min", self.rollout_correction in ROLLOUT_MODES,
             f"rollout_correction={modes}; rollout_correction={self.rollout_correction!r}"),
            ("dppo_mask_low dppo_mask_high", self.rollout_correction == "dppo_mask",
             "rollout_correction='dppo_mask'"),
            ("kl_estimator kl_bias_correction", self.kl_beta != 0.0, "kl_beta != 0"),
            ("delta", self.loss_type in CLIP_LOSS_TYPES, f"loss_type={'/'.join(CLIP_LOSS_TYPES)}"),
            ("max_completion_length", self.loss_type == "dr_grpo", "loss_type='dr_grpo'"),
            ("sapo_temperature_pos sapo_temperature_neg", self.loss_type == "sapo", "loss_type='sapo'"),
            ("vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg", self.loss_type == "vespo",
             "loss_type='vespo'"),
        )  # fmt: skip
        return [
            f"`{name}`={getattr(self, name)!r} (acts only with {mode})"
            for names, active, mode in rules
            if not active
            for name in names.split()
            if _non_default(self, name)
        ]


# ----------------------------------------------------------------------------------------------- channel 2
@dataclass(frozen=True)
class TAID:
    """TAID wrapper (:func:`composer_core.loss.wrappers.taid_loss`). Flat names ``taid_<field>``.

    Give ``t`` (e.g. ``TAIDScheduler.t``) or ``schedule_step`` + ``total_steps`` (linear ``t_start → t_end``).
    """

    t: float | None = _opt(None, "TAID's interpolation t of this step, in [0, 1] (e.g. TAIDScheduler.t).")
    schedule_step: int | None = _opt(None, "step of TAID's linear t schedule (with total_steps).")
    total_steps: int | None = _opt(None, "length of TAID's linear schedule in steps.")
    t_start: float = _opt(0.4, "TAID initial t.")
    t_end: float = _opt(1.0, "TAID final t.")

    def __post_init__(self) -> None:
        check_probability("taid_t_start", self.t_start)
        check_probability("taid_t_end", self.t_end)
        if self.t_start > self.t_end:
            raise ValueError(f"`taid_t_start`={self.t_start} must not exceed `taid_t_end`={self.t_end}.")
        if self.t is not None:
            check_probability("taid_t", self.t)
        if self.total_steps is not None:
            check_int("taid_total_steps", self.total_steps, low=1)
        if self.schedule_step is not None:
            check_int("taid_schedule_step", self.schedule_step, low=0)
        if self.t is not None and (self.schedule_step is not None or self.total_steps is not None):
            raise ValueError(
                "pass either `taid_t` (e.g. TAIDScheduler.t) or `taid_schedule_step` + `taid_total_steps` "
                "(linear schedule), not both."
            )

    def resolve_t(self) -> float:
        """The interpolation t of this step (raises if neither ``t`` nor the schedule is given)."""
        if self.t is not None:
            return float(self.t)
        if self.schedule_step is None or self.total_steps is None:
            raise ValueError(
                "sdpo_wrapper='taid' needs the interpolation t: pass `taid_t` (e.g. from TAIDScheduler.t) or both "
                "`taid_schedule_step` and `taid_total_steps` for the linear t_start→t_end schedule."
            )
        return self.t_start + (self.t_end - self.t_start) * min(self.schedule_step / self.total_steps, 1.0)


@dataclass(frozen=True)
class EntropyOPD:
    """Entropy-aware OPD wrapper (:func:`composer_core.loss.wrappers.entropy_opd_loss`).
    Flat names ``entropy_opd_threshold`` / ``entropy_opd_weight``."""

    threshold: float = _opt(0.8, "teacher-entropy gate (nats) of sdpo_wrapper='entropy_opd'.")
    weight: float = _opt(1.0, "weight of the gated forward KL.")

    def __post_init__(self) -> None:
        check_number("entropy_opd_threshold", self.threshold, low=0.0)
        check_number("entropy_opd_weight", self.weight, low=0.0, strict=True)


@dataclass(frozen=True)
class SDPOOptions:
    """Channel 2. Flat names ``sdpo_<field>`` (``sdpo_wrapper`` selects ``wrapper``: ``"none"`` → None,
    ``"taid"`` → :class:`TAID`, ``"entropy_opd"`` → :class:`EntropyOPD`).

    ``form="auto"`` is resolved per batch (:meth:`resolve_form`): top-k if ``topk`` is set and logits are present
    (and no wrapper), else full logits, else fused hidden states, else the sampled-token form; an option the
    resolved form does not read raises (:meth:`unused`; ``topk`` also acts with the entropy-OPD wrapper, which
    needs ``"full"``). ``token_clip`` (:func:`~composer_core.loss.distill.is_clip_weight`) acts when the batch
    carries ``old_logprobs``. ``loss_agg``'s normaliser ``sdpo_normalizer`` is the global token count
    (``"token_mean"``) or the global row count, distilled or not (``"seq_mean"``).
    """

    form: SDPOForm = _opt(
        "auto",
        "'full': generalized JSD over the whole vocabulary (logits, or chunk-wise from hidden states and the "
        "LM head, never [B, T, V]); 'topk': on the student's top-sdpo_topk tokens (TRL SDPOTrainer's "
        "topk_logits); 'sampled': the reverse-KL estimator on the sampled token; 'auto': from the batch.",
    )
    beta: float = _opt(0.5, "generalized-JSD beta (TRL GKD: 0 forward KL, 1 reverse KL).")
    temperature: float = _opt(1.0, "temperature of both distributions in the divergence.")
    token_clip: float | None = _opt(2.0, "IS clip: min(exp(logp - old_logp), clip) per token (None: off).")
    topk: int | None = _opt(None, "top-k support size of sdpo_form='topk' (the student's top k).")
    topk_tail: bool = _opt(True, "sdpo_form='topk': add the tail bucket 1 - sum_k p (distillation_add_tail).")
    chunk_size: int | None = _opt(None, "rows per chunk of the full-vocabulary kernels (None: from V).")
    compiled: bool = _opt(False, "the JSD chunk kernel under torch.compile (sdpo_form='full', no wrapper).")
    loss_agg: SDPOLossAgg = _opt("token_mean", "'token_mean' (lasgroup/SDPO), 'seq_mean' (TRL SDPOTrainer).")
    wrapper: TAID | EntropyOPD | None = None

    def __post_init__(self) -> None:
        check_choice("sdpo_form", self.form, ("auto", "full", "topk", "sampled"))
        check_choice("sdpo_loss_agg", self.loss_agg, ("token_mean", "seq_mean"))
        if not isinstance(self.wrapper, (TAID, EntropyOPD, type(None))):
            raise TypeError(f"`wrapper` must be None, TAID(...) or EntropyOPD(...), got {self.wrapper!r}.")
        check_probability("sdpo_beta", self.beta)
        check_bool("sdpo_topk_tail", self.topk_tail)
        check_number("sdpo_temperature", self.temperature, low=0.0, strict=True)
        if self.token_clip is not None:
            check_number("is_clip (sdpo_token_clip)", self.token_clip, low=0.0, strict=True)
        check_chunk_size("sdpo_chunk_size", self.chunk_size)
        check_bool("sdpo_compiled", self.compiled)
        if self.topk is not None:
            check_int("sdpo_topk", self.topk, low=1)
        if self.form != "auto":
            self.structural_errors(self.form)
            _raise_unused(self.unused(self.form))

    @property
    def wrapper_name(self) -> SDPOWrapper:
        names: dict[type, SDPOWrapper] = {TAID: "taid", EntropyOPD: "entropy_opd"}
        return names.get(type(self.wrapper), "none")

    def resolve_form(self, *, has_logits: bool, has_hidden: bool, has_sampled: bool) -> ResolvedForm | None:
        """The form a batch with these channel-2 inputs runs (None: no channel-2 input, the channel is skipped)."""
        if self.form != "auto":
            return self.form
        if has_logits:
            return "topk" if (self.topk is not None and self.wrapper is None) else "full"
        if has_hidden:
            return "full"
        if has_sampled:
            return "sampled"
        return None

    def structural_errors(self, form: str) -> None:
        """Raise for a wrapper / ``topk`` that the resolved ``form`` cannot run."""
        wrapper = self.wrapper_name
        if self.topk is not None and form != "topk" and wrapper != "entropy_opd":
            raise ValueError(
                f"`sdpo_topk`={self.topk!r} only applies to the top-k form (student/teacher logits) or the "
                f"entropy_opd wrapper, but the SDPO form is {form!r} with sdpo_wrapper={wrapper!r}: drop "
                "`sdpo_topk`, or pass logits with sdpo_form='topk'."
            )
        if wrapper != "none" and form != "full":
            raise ValueError(
                f"sdpo_wrapper={wrapper!r} needs full-vocabulary inputs (student/teacher logits or hidden states "
                f"+ lm_head_weight), but the SDPO form is {form!r}; set sdpo_form='full'."
            )
        if form == "topk" and self.topk is None:
            raise ValueError("sdpo_form='topk' needs `sdpo_topk` (the support size k).")

    def unused(self, form: str) -> list[str]:
        """Messages for options that the resolved ``form`` does not read."""
        rules = (
            ("beta", form == "sampled" and self.beta not in (0.5, 1.0),
             "a generalized-JSD form: sdpo_form='sampled' is always the reverse-KL estimator, beta 1"),
            ("temperature", form == "sampled" and _non_default(self, "temperature"), "sdpo_form='full'/'topk'"),
            ("compiled", self.compiled and (form != "full" or self.wrapper is not None),
             "sdpo_form='full' and no wrapper: it compiles the generalized-JSD chunk kernel"),
            ("beta", isinstance(self.wrapper, TAID) and _non_default(self, "beta"),
             "a generalized-JSD form: sdpo_wrapper='taid' distils with its own divergence"),
            ("chunk_size", form in ("sampled", "topk") and _non_default(self, "chunk_size"),
             "the full-vocabulary kernels"),
            ("topk_tail", form != "topk" and _non_default(self, "topk_tail"), "sdpo_form='topk'"),
        )  # fmt: skip
        how = "given" if self.form != "auto" else "resolved from the batch"
        return [
            f"`sdpo_{name}`={getattr(self, name)!r} (acts only with {mode}; the form is {form!r} ({how}), "
            f"sdpo_wrapper={self.wrapper_name!r})"
            for name, unused, mode in rules
            if unused
        ]


# ----------------------------------------------------------------------------------------------- channel 3
_RPO_HELP = (
    "weight of the chosen side's NLL added to each pair's DPO/SimPO loss (iterative RPO, arXiv 2404.19733; TRL's "
    "loss_type=['sigmoid', 'sft']); 0 = none."
)


@dataclass(frozen=True)
class DPO:
    """DPO family (:func:`composer_core.loss.preference.dpo_loss`). Flat names ``dpo_<field>``, except
    ``rpo_alpha`` (flat name ``rpo_alpha``, shared with :class:`SimPO`)."""

    beta: float = _opt(0.1, "DPO beta.")
    loss_type: DPOLossType = _opt("sigmoid", "DPO loss: 'sigmoid', 'robust' or 'ipo'.")
    label_smoothing: float = _opt(0.0, "cDPO / robust epsilon.")
    rpo_alpha: float = _opt(0.0, _RPO_HELP)

    def __post_init__(self) -> None:
        check_number("rpo_alpha", self.rpo_alpha, low=0.0)
        check_choice("dpo_loss_type", self.loss_type, ("sigmoid", "robust", "ipo"))
        check_number("dpo_beta", self.beta, low=0.0, strict=True)
        check_number("dpo_label_smoothing", self.label_smoothing, low=0.0)
        eps = self.label_smoothing
        if not {"sigmoid": eps <= 0.5, "robust": eps < 0.5, "ipo": eps == 0.0}[self.loss_type]:
            top = {"sigmoid": "0.5]", "robust": "0.5)", "ipo": "0]"}[self.loss_type]
            raise ValueError(
                f"`dpo_label_smoothing`={self.label_smoothing!r} must lie in [0, {top} for dpo_loss_type="
                f"{self.loss_type!r}."
            )


@dataclass(frozen=True)
class SimPO:
    """SimPO (:func:`composer_core.loss.preference.simpo_loss`). Flat names ``simpo_beta`` / ``simpo_gamma`` /
    ``rpo_alpha`` (the chosen side's NLL weight, as in :class:`DPO`)."""

    beta: float = _opt(2.0, "SimPO beta.")
    gamma: float = _opt(0.5, "SimPO absolute margin gamma.")
    rpo_alpha: float = _opt(0.0, _RPO_HELP)

    def __post_init__(self) -> None:
        check_number("rpo_alpha", self.rpo_alpha, low=0.0)
        check_number("simpo_beta", self.beta, low=0.0, strict=True)
        check_number("simpo_gamma", self.gamma, low=0.0)
