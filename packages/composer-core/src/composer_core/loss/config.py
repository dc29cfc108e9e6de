"""``ComposeConfig``: the one typed, frozen home of every :func:`~composer_core.loss.compose.compose_loss`
option and default.

The shape makes an option of an unselected mode impossible to write down::

    ComposeConfig(
        w_policy=1.0, alpha_sdpo=1.0, beta_replay=1.0,
        policy=PolicyOptions(loss_type="dapo", kl_beta=0.0, ...),
        sdpo=SDPOOptions(form="auto", beta=0.5, wrapper=None | TAID(...) | EntropyOPD(...)),
        replay=DPO(beta=0.1, ...) | SimPO(beta=2.0, gamma=0.5),
        check_values=True,
    )

``SimPO`` has no ``dpo_beta`` field, ``SDPOOptions(wrapper=None)`` no ``taid_t``: a flat keyword that belongs to
an unselected mode has nowhere to go, and :meth:`ComposeConfig.from_flat` (the flat keyword facade of
``compose_loss`` and of every adapter) raises ``ValueError`` naming it. Within one class, an option that acts
only under another value of a sibling (``rollout_clip_max`` without ``rollout_correction``, ``kl_estimator``
with ``kl_beta=0``, ``sdpo_topk_tail`` outside the top-k form, ...) is refused by ``__post_init__``, and the
SDPO form ``"auto"`` is judged again once resolved against a batch (:meth:`ComposeConfig.resolve`).

``from_flat`` also coerces values the way a typed config loader would, so options arriving as strings from a
command line work: ``"0.25"`` → 0.25 for a float, ``"3"`` → 3 for an int, ``"true"/"false"/"1"/"0"/"yes"/"no"``
for a bool, ``"none"/"null"/""`` → None where None is allowed, ``Literal`` choices checked; anything else is one
``ValueError`` naming the option and the expected type.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any, Literal, Union, get_args, get_origin

from composer_core.loss.chunking import check_chunk_size
from composer_core.loss.surrogates import IS_LEVELS, ISLevel
from composer_core.loss.validation import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_positive,
    check_probability,
)

__all__ = [
    "CLIP_LOSS_TYPES",
    "DPO",
    "LOSS_TYPES",
    "ROLLOUT_MODES",
    "TAID",
    "ComposeConfig",
    "EntropyOPD",
    "PolicyOptions",
    "SDPOOptions",
    "SimPO",
    "check_clip_args",
    "check_rollout_clip",
    "coerce_option",
    "coerce_to",
    "flat_defaults",
    "flat_option_names",
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
        check_positive(f"{prefix}clip_max", clip_max)
    if clip_min is not None:
        check_number(f"{prefix}clip_min", clip_min, low=0.0)
    if clip_min is not None and clip_max is not None and clip_min > clip_max:
        raise ValueError(f"`{prefix}clip_min`={clip_min} exceeds `{prefix}clip_max`={clip_max}.")


# ----------------------------------------------------------------------------------------------- channel 1
@dataclass(frozen=True)
class PolicyOptions:
    """Channel 1: the options of :func:`composer_core.loss.policy.policy_loss`, checked here once (ranges and
    combinations; ``policy_loss`` checks only its tensors per call). Flat names: the same field names.

    - ``loss_type``: the surrogate and its aggregation (:func:`~composer_core.loss.policy.aggregate_loss`).
      ``epsilon_low``/``epsilon_high``: the clip range, ``0 ≤ ε_lo < 1``, ``ε_hi ≥ 0`` (None = ε_lo; CISPO's
      ratio cap). ``delta``: INTELLECT-2's cap of the unclipped ratio, ``δ > 1 + ε_hi``. ``max_completion_length``:
      Dr. GRPO's ``L_max`` (an int ≥ 1; None = T).
    - ``kl_beta`` / ``kl_estimator``: KL-to-reference coefficient and estimator
      (:func:`~composer_core.loss.policy.kl_penalty`). ``kl_bias_correction``: multiply the per-token KL by the
      (unclipped) ratio ρ = exp(ℓθ − ℓold), the importance-sampling correction of TRL's
      ``use_bias_correction_kl=True`` (its default): the KL is estimated on samples of πold, not πθ.
    - ``rollout_correction``: weights computed in ``policy_loss``, a
      :func:`~composer_core.loss.policy.rollout_correction_weights` mode (bounds ``rollout_clip_min`` ≥ 0,
      ``rollout_clip_max`` > 0), or ``"dppo_mask"`` (zero the surrogate on the tokens
      :func:`~composer_core.loss.policy.dppo_mask` flags; bounds ``dppo_mask_low``/``dppo_mask_high`` in [0, 1]).
    - ``importance_sampling_level``: ``'token'`` or ``'sequence'`` (GSPO, arXiv 2507.18071).
    - ``sapo_temperature_pos`` / ``sapo_temperature_neg``: SAPO's τ for ``A > 0`` / ``A ≤ 0``;
      ``vespo_k_pos`` / ``vespo_lambda_pos`` / ``vespo_k_neg`` / ``vespo_lambda_neg``: VESPO's gamma shape.

    An option outside its mode (see :meth:`unused`) at a non-default value raises ``ValueError``.
    """

    loss_type: LossType = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    kl_beta: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_bias_correction: bool = False
    rollout_correction: RolloutCorrection | None = None
    rollout_clip_max: float | None = 3.0
    rollout_clip_min: float | None = None
    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    max_completion_length: int | None = None
    importance_sampling_level: ISLevel = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

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
        eps_lo = float(self.epsilon_low)
        return eps_lo, eps_lo if self.epsilon_high is None else float(self.epsilon_high)

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

    t: float | None = None
    schedule_step: int | None = None
    total_steps: int | None = None
    t_start: float = 0.4
    t_end: float = 1.0

    def __post_init__(self) -> None:
        check_probability("taid_t_start", self.t_start)
        check_probability("taid_t_end", self.t_end)
        if self.t_start > self.t_end:
            raise ValueError(f"`taid_t_start`={self.t_start} must not exceed `taid_t_end`={self.t_end}.")
        if self.t is not None:
            check_probability("taid_t", self.t)
        for name, value, low in (
            ("taid_total_steps", self.total_steps, 1),
            ("taid_schedule_step", self.schedule_step, 0),
        ):
            if value is not None:
                check_int(name, value, low=low)
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

    threshold: float = 0.8
    weight: float = 1.0

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
    needs ``"full"``). ``topk_tail``: add the tail bucket ``1 − Σ_k p`` (False is TRL SDPO's
    ``distillation_add_tail=False``); ``compiled``: the JSD chunk kernel under ``torch.compile``. ``token_clip``
    (every form): the importance-sampling clip of the distillation loss on tokens sampled by an older policy,
    ``w = min(exp(ℓθ − ℓold), token_clip)`` per token (:func:`~composer_core.loss.distill.is_clip_weight`; TRL
    SDPOTrainer's ``distillation_is_clip``); it acts when the batch carries ``old_logprobs``, None disables it.

    ``loss_agg`` (every form): ``"token_mean"`` (default; lasgroup/SDPO's verl ``token-mean``) divides the sum over
    distilled tokens by their count (``sdpo_normalizer``: the global count); ``"seq_mean"`` (TRL
    ``trl.experimental.sdpo.SDPOTrainer``) averages each row over its distilled tokens, then divides the sum of
    row means by the number of rows, distilled or not (``sdpo_normalizer``: the global row count).
    """

    form: SDPOForm = "auto"
    beta: float = 0.5
    temperature: float = 1.0
    token_clip: float | None = 2.0
    topk: int | None = None
    topk_tail: bool = True
    chunk_size: int | None = None  # None: rows per chunk from V (composer_core.loss.chunking.chunk_rows)
    compiled: bool = False
    loss_agg: SDPOLossAgg = "token_mean"
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
@dataclass(frozen=True)
class DPO:
    """DPO family (:func:`composer_core.loss.preference.dpo_loss`). Flat names ``dpo_<field>``, except
    ``rpo_alpha`` (flat name ``rpo_alpha``, shared with :class:`SimPO`): the weight of the chosen side's NLL term
    (iterative RPO, Pang et al., arXiv 2404.19733; 0 = none)."""

    beta: float = 0.1
    loss_type: DPOLossType = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0

    def __post_init__(self) -> None:
        check_number("rpo_alpha", self.rpo_alpha, low=0.0)
        check_choice("dpo_loss_type", self.loss_type, ("sigmoid", "robust", "ipo"))
        check_number("dpo_beta", self.beta, low=0.0, strict=True)
        check_number("dpo_label_smoothing", self.label_smoothing, low=0.0)
        top = {"sigmoid": "0.5]", "robust": "0.5)", "ipo": "0]"}[self.loss_type]
        if (
            self.label_smoothing > 0.5
            or (self.label_smoothing == 0.5 and top != "0.5]")
            or (self.loss_type == "ipo" and self.label_smoothing != 0.0)
        ):
            raise ValueError(
                f"`dpo_label_smoothing`={self.label_smoothing!r} must lie in [0, {top} for dpo_loss_type="
                f"{self.loss_type!r}."
            )


@dataclass(frozen=True)
class SimPO:
    """SimPO (:func:`composer_core.loss.preference.simpo_loss`). Flat names ``simpo_beta`` / ``simpo_gamma`` /
    ``rpo_alpha`` (the chosen side's NLL weight, as in :class:`DPO`)."""

    beta: float = 2.0
    gamma: float = 0.5
    rpo_alpha: float = 0.0

    def __post_init__(self) -> None:
        check_number("rpo_alpha", self.rpo_alpha, low=0.0)
        check_number("simpo_beta", self.beta, low=0.0, strict=True)
        check_number("simpo_gamma", self.gamma, low=0.0)


# ----------------------------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class ComposeConfig:
    """Everything :func:`~composer_core.loss.compose.compose_loss` needs besides the batch and the per-step
    normalisers. Build it once (directly, or with :meth:`from_flat` from the flat keyword names) and pass it
    on every call.

    ``w_policy`` / ``alpha_sdpo`` / ``beta_replay``: the channel weights of ``total = w_policy·policy +
    alpha_sdpo·sdpo + beta_replay·replay`` (finite, >= 0, not all 0). ``w_policy=0`` is pure self-distillation
    (TRL SDPOTrainer's ``distillation_weight=1``): the policy term is not computed at all (``kl_beta`` must be 0).

    ``check_values``: run the value checks (finite inputs, 0/1 masks, non-empty selections, positive lengths and
    normalisers) fused into one host sync per ``compose_loss`` call; ``False`` skips them (no host sync at all)
    for hot loops whose inputs are trusted. They are skipped under ``torch.compile`` either way. Structural
    checks (shapes, dtypes, devices, options) always run and never read device memory.
    """

    w_policy: float = 1.0
    alpha_sdpo: float = 1.0
    beta_replay: float = 1.0
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    sdpo: SDPOOptions = field(default_factory=SDPOOptions)
    replay: DPO | SimPO = field(default_factory=DPO)
    check_values: bool = True

    def __post_init__(self) -> None:
        for name in ("w_policy", "alpha_sdpo", "beta_replay"):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not (0.0 <= float(w) < float("inf")):
                raise ValueError(f"`{name}`={w!r} must be a finite weight >= 0 (0 disables the channel).")
        if self.w_policy == self.alpha_sdpo == self.beta_replay == 0:
            raise ValueError(
                "`w_policy`, `alpha_sdpo` and `beta_replay` are all 0: nothing to train; set w_policy=1 (the policy "
                "term) or alpha_sdpo > 0 (w_policy=0, alpha_sdpo=1 is pure self-distillation)."
            )
        if self.w_policy == 0 and self.policy.kl_beta != 0:
            raise ValueError(
                f"`kl_beta`={self.policy.kl_beta!r} is part of the policy term, which w_policy=0 does not compute: "
                "set kl_beta=0 or w_policy > 0."
            )
        for name, value, kinds in (
            ("policy", self.policy, (PolicyOptions,)),
            ("sdpo", self.sdpo, (SDPOOptions,)),
            ("replay", self.replay, (DPO, SimPO)),
        ):
            if not isinstance(value, kinds):
                raise TypeError(f"`{name}` must be {' | '.join(k.__name__ for k in kinds)}, got {value!r}.")
        if self.beta_replay == 0 and self.replay.rpo_alpha != 0:
            raise ValueError(
                f"`rpo_alpha`={self.replay.rpo_alpha!r} acts only with channel 3 on (beta_replay > 0, it is 0): "
                "set beta_replay > 0 or drop rpo_alpha."
            )

    @property
    def dpo_variant(self) -> DPOVariant:
        return "simpo" if isinstance(self.replay, SimPO) else "dpo"

    def resolve(self, *, has_logits: bool, has_hidden: bool, has_sampled: bool) -> ResolvedForm | None:
        """Resolve ``sdpo.form`` against which channel-2 inputs a batch has, and judge the options in that form
        (raises ``ValueError`` naming every option the resolved form ignores). Pure Python, no host sync."""
        form = self.sdpo.resolve_form(has_logits=has_logits, has_hidden=has_hidden, has_sampled=has_sampled)
        if form is not None and self.sdpo.form == "auto":
            self.sdpo.structural_errors(form)
            _raise_unused(self.sdpo.unused(form))
        return form

    @classmethod
    def from_flat(
        cls,
        *,
        has_logits: bool | None = None,
        has_hidden: bool | None = None,
        has_sampled: bool | None = None,
        **options: object,
    ) -> ComposeConfig:
        """Build the config from ``compose_loss``'s flat keyword names (coercing CLI strings).

        Raises ``ValueError`` for an unknown name (with the closest match), a value of the wrong type, and —
        all named in one message — every option that has no effect in the selected modes. With the
        ``has_*`` flags (which channel-2 inputs the batch carries), ``sdpo_form="auto"`` is resolved and the
        options are judged in the resolved form.
        """
        return _from_flat_cached(_freeze(options), (has_logits, has_hidden, has_sampled))

    def to_flat(self) -> dict[str, object]:
        """The flat keyword form of this config (every option, including defaults)."""
        out: dict[str, object] = {name: getattr(self, name) for name in _TOP}
        for obj in (self.policy, self.sdpo, self.sdpo.wrapper, self.replay):
            if obj is not None:
                prefix = next(prefix for klass, prefix, _ in _SECTIONS if klass is type(obj))
                out.update(
                    {_flat_name(prefix, f.name): getattr(obj, f.name) for f in dataclasses.fields(obj)}
                )
        out.update(sdpo_wrapper=self.sdpo.wrapper_name, dpo_variant=self.dpo_variant)
        return out


# ----------------------------------------------------------------------------------------------- flat names
#: flat name -> (class holding it, field name, the selector value that puts the class in use)
_SECTIONS: tuple[tuple[type, str, str | None], ...] = (
    (PolicyOptions, "", None),
    (SDPOOptions, "sdpo_", None),
    (TAID, "taid_", "sdpo_wrapper='taid'"),
    (EntropyOPD, "entropy_opd_", "sdpo_wrapper='entropy_opd'"),
    (DPO, "dpo_", "dpo_variant='dpo'"),
    (SimPO, "simpo_", "dpo_variant='simpo'"),
)
_SELECTORS: dict[str, tuple[object, tuple[object, ...]]] = {
    "sdpo_wrapper": ("none", ("none", "taid", "entropy_opd")),
    "dpo_variant": ("dpo", ("dpo", "simpo")),
}
_TOP = ("w_policy", "alpha_sdpo", "beta_replay", "check_values")
#: fields of both replay classes whose flat name has no prefix (the selected variant's class takes it)
_SHARED_REPLAY = ("rpo_alpha",)
#: per-call values of compose_loss that are not options of the config
PER_CALL = ("normalizer", "sdpo_normalizer", "replay_normalizer")


def _flat_name(prefix: str, name: str) -> str:
    return name if name in _SHARED_REPLAY else prefix + name


def _flat_table() -> dict[str, tuple[type, str, str | None]]:
    table: dict[str, tuple[type, str, str | None]] = {name: (ComposeConfig, name, None) for name in _TOP}
    for klass, prefix, selector in _SECTIONS:
        for f in dataclasses.fields(klass):
            if f.name != "wrapper":
                table[_flat_name(prefix, f.name)] = (klass, f.name, selector)
    for name in _SHARED_REPLAY:  # in whichever replay class dpo_variant selects
        table[name] = (DPO, name, None)
    return table


_FLAT = _flat_table()


def flat_option_names() -> tuple[str, ...]:
    """Every flat option name of ``compose_loss`` (config options, mode selectors, per-call normalisers)."""
    return (*_FLAT, *_SELECTORS, *PER_CALL)


def _default(klass: type, name: str) -> object:
    f = next(f for f in dataclasses.fields(klass) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING
    return f.default_factory()


def flat_defaults() -> dict[str, object]:
    """The default of every flat option (read from the config classes; adapters take their defaults here)."""
    out: dict[str, object] = {name: _default(klass, fname) for name, (klass, fname, _) in _FLAT.items()}
    out.update({name: default for name, (default, _) in _SELECTORS.items()})
    return out


def _non_default(obj: object, name: str) -> bool:
    return bool(getattr(obj, name) != _default(type(obj), name))


# ----------------------------------------------------------------------------------------------- coercion
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null", "")


@cache
def _hints(klass: type) -> dict[str, Any]:
    return typing.get_type_hints(klass)


def _annotation(name: str) -> Any:
    if name in _SELECTORS:
        return Literal[_SELECTORS[name][1]]
    klass, fname, _ = _FLAT[name]
    return _hints(klass)[fname]


def _describe(ann: Any) -> str:
    origin = get_origin(ann)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, get_args(ann)))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(ann))
    if ann is type(None):
        return "None"
    return getattr(ann, "__name__", str(ann))


def coerce_option(name: str, value: object) -> object:
    """Coerce one flat option value to its declared type (strings from a CLI included); ``ValueError`` naming
    the option and the expected type for anything that does not convert."""
    return coerce_to(name, value, _annotation(name))


def coerce_to(name: str, value: object, ann: Any) -> object:
    """Coerce ``value`` to the type annotation ``ann`` (``float``, ``int``, ``bool``, ``Literal[...]`` and their
    unions with None), as :meth:`ComposeConfig.from_flat` does; adapters use it for their own options."""
    try:
        return _coerce(ann, value)
    except (TypeError, ValueError):
        raise ValueError(
            f"`{name}`={value!r} ({type(value).__name__}) is not a valid value: expected {_describe(ann)}."
        ) from None


def _coerce(ann: Any, value: object) -> object:
    origin = get_origin(ann)
    if origin in (Union, types.UnionType):
        return _coerce_union(get_args(ann), value)
    if origin is Literal:
        return _coerce_literal(get_args(ann), value)
    scalar = _SCALARS.get(ann)
    if scalar is None:
        raise TypeError(value)
    return scalar(value)


def _coerce_union(args: tuple[Any, ...], value: object) -> object:
    if type(None) in args and (value is None or (isinstance(value, str) and value.strip().lower() in _NONE)):
        return None
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(arg, value)
        except (TypeError, ValueError):
            continue
    raise ValueError(value)


def _coerce_literal(choices: tuple[Any, ...], value: object) -> object:
    if value in choices and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip() in choices:
        return value.strip()
    if isinstance(value, str) and value.strip().lower() in _NONE and None in choices:
        return None
    raise ValueError(value)


def _to_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(value)


def _to_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(value)
    return value if isinstance(value, int) else int(value.strip())


def _to_float(value: object) -> float:
    if isinstance(value, bool):
        raise TypeError(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip():
        return float(value.strip())
    raise TypeError(value)


_SCALARS: dict[Any, Any] = {bool: _to_bool, int: _to_int, float: _to_float}


# ----------------------------------------------------------------------------------------------- from_flat
def _freeze(options: Mapping[str, object]) -> tuple[tuple[str, object], ...]:
    # the type joins the key: 1, 1.0 and True hash alike but do not coerce alike (True is no int option)
    return tuple(sorted((k, (type(v).__name__, v)) for k, v in options.items()))


def _reject_unknown(names: list[str]) -> None:
    if not names:
        return
    known = flat_option_names()
    hints = []
    for key in sorted(names):
        close = difflib.get_close_matches(key, known, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(
        f"compose_loss() got unknown option(s) {', '.join(hints)}; see its docstring for the options."
    )


def _from_flat(
    items: tuple[tuple[str, object], ...], batch_flags: tuple[bool | None, bool | None, bool | None]
) -> ComposeConfig:
    given = {k: tv[1] for k, tv in items}  # type: ignore[index]
    _reject_unknown([k for k in given if k not in _FLAT and k not in _SELECTORS])
    values = {k: coerce_option(k, v) for k, v in given.items()}
    wrapper = values.get("sdpo_wrapper", "none")
    variant = values.get("dpo_variant", "dpo")
    selected = {f"sdpo_wrapper={wrapper!r}", f"dpo_variant={variant!r}"}
    unused: list[str] = []
    sections: dict[type, dict[str, object]] = {klass: {} for klass, _, _ in _SECTIONS}
    sections[ComposeConfig] = {}
    for name, value in values.items():
        if name in _SELECTORS:
            continue
        klass, fname, selector = _FLAT[name]
        if name in _SHARED_REPLAY and variant == "simpo":
            klass = SimPO
        if selector is not None and selector not in selected:
            if value != _default(klass, fname):
                unused.append(f"`{name}`={value!r} (acts only with {selector})")
            continue
        sections[klass][fname] = value
    # judge every class's mode-dependent options together, so one message names them all
    policy_kw = sections[PolicyOptions]
    sdpo_kw = sections[SDPOOptions]
    unused += _unchecked(PolicyOptions, policy_kw).unused()
    probe_sdpo = _unchecked(SDPOOptions, sdpo_kw)
    wrapper_cls: Any = {"taid": TAID, "entropy_opd": EntropyOPD}.get(str(wrapper))
    if wrapper_cls is not None:
        object.__setattr__(probe_sdpo, "wrapper", _unchecked(wrapper_cls, sections[wrapper_cls]))
    form: str | None = probe_sdpo.form
    if form == "auto" and None not in batch_flags:
        has_logits, has_hidden, has_sampled = map(bool, batch_flags)
        form = probe_sdpo.resolve_form(has_logits=has_logits, has_hidden=has_hidden, has_sampled=has_sampled)
    if form is not None and form != "auto":
        probe_sdpo.structural_errors(form)
        unused += probe_sdpo.unused(form)
    _raise_unused(unused)
    wrapper_obj = None if wrapper_cls is None else wrapper_cls(**sections[wrapper_cls])
    replay: DPO | SimPO = SimPO(**sections[SimPO]) if variant == "simpo" else DPO(**sections[DPO])  # type: ignore[arg-type]
    return ComposeConfig(
        policy=PolicyOptions(**policy_kw),  # type: ignore[arg-type]
        sdpo=SDPOOptions(**sdpo_kw, wrapper=wrapper_obj),  # type: ignore[arg-type]
        replay=replay,
        **sections[ComposeConfig],  # type: ignore[arg-type]
    )


def _unchecked(klass: type, kw: Mapping[str, object]) -> Any:
    """An instance without running ``__post_init__`` (to collect every mode message before raising)."""
    obj: Any = object.__new__(klass)
    for f in dataclasses.fields(klass):
        object.__setattr__(obj, f.name, kw.get(f.name, _default(klass, f.name)))
    return obj


_cached = lru_cache(maxsize=256)(_from_flat)


def _from_flat_cached(
    items: tuple[tuple[str, object], ...], flags: tuple[bool | None, bool | None, bool | None]
) -> ComposeConfig:
    try:
        return _cached(items, flags)
    except TypeError as err:  # an unhashable value (a list from TOML): build uncached
        if "unhashable" not in str(err):
            raise
        return _from_flat(items, flags)
