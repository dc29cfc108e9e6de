"""The ``[trainer.loss.kwargs]`` table of ``composer_loss``, validated.

PRIME-RL forwards ``CustomLossConfig.kwargs`` verbatim on every per-sample call, so a
typo or an option that cannot work per sample would otherwise be silently ignored.
:func:`parse_options` turns the kwargs into a frozen :class:`PrimeRLLossOptions` and raises
``ValueError`` for anything it cannot honour, naming the option and the fix:

- an unknown key (the message lists the valid ones);
- a composer option that exists in ``composer_core.compose_loss`` but cannot be computed
  from PRIME-RL's per-sample, sampled-token inputs (full-vocabulary SDPO and its
  wrappers, channel 3 preference replay, per-sequence aggregation, ...): the message
  says why and what to do instead;
- an option of the policy loss that is not selected (e.g. ``epsilon_low`` with
  ``policy_loss = "dppo"``), which would otherwise do nothing;
- a value of the wrong type or out of range.
"""

from __future__ import annotations

import inspect
import math
import typing
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Literal

from composer_core.loss.config import (
    DPO,
    TAID,
    ComposeConfig,
    EntropyOPD,
    PolicyOptions,
    SDPOOptions,
    SimPO,
    coerce_to,
    flat_defaults,
    flat_option_names,
)
from composer_core.loss.policy import check_clip_args, dppo_loss

__all__ = ["PrimeRLLossOptions", "parse_options", "valid_option_names"]

PolicyLoss = Literal["dppo", "clipped_surrogate"]

#: composer_core's defaults (the one source of truth) for the options this adapter shares with core.
_CORE = flat_defaults()
_DPPO = {name: p.default for name, p in inspect.signature(dppo_loss).parameters.items()}


@dataclass(frozen=True)
class PrimeRLLossOptions:
    """Options of ``composer_prime_rl.composer_loss`` (keys of ``[trainer.loss.kwargs]``).

    Channel 1, the policy loss (``policy_loss``):

    - ``"dppo"`` (default): PRIME-RL's own default rl loss, DPPO-Binary-TV probability-
      difference masking with advantage-sign-dependent bounds plus the Kimi-K2.5
      squared-log-ratio term. Options ``dppo_mask_low``, ``dppo_mask_high``, ``adv_tau``,
      ``kl_tau`` (same names and defaults as PRIME-RL's ``DefaultLossConfig``;
      ``kl_tau = 0`` drops the squared-log-ratio term).
    - ``"clipped_surrogate"``: the PPO/GRPO clipped surrogate with the importance ratio
      against ``inference_logprobs``. Options ``epsilon_low``, ``epsilon_high`` (None =
      ``epsilon_low``), ``delta`` (cap on the ratio in the unclipped branch, None = off).

    Channel 2, sampled-token self-distillation (``alpha_sdpo > 0``): the per-sample
    ``ref_logprobs`` (hinted-context log-probs of the sampled tokens) are the teacher.
    ``sdpo_token_clip`` caps the detached importance weight ``exp(ℓ_train − ℓ_inf)``;
    None (``false`` in TOML) drops the weight (w = 1, TRL's ``distillation_is_clip=None``).
    ``sdpo_missing`` decides what a sample with ``ref_logprobs = None`` does: ``"error"``
    (default) raises, ``"skip"`` trains it on channel 1 only and reports ``composer/sdpo/skipped = 1``
    (an all-zero ``ref_logprobs``, PRIME-RL's packer fill, is always skipped).
    ``sdpo_form`` accepts ``"sampled"`` (or ``"auto"``, which can only pick it here).

    Channel 3 (``beta_replay``) only accepts 0: preference pairs cannot be formed per sample.

    Defaults shared with composer_core (``dppo_mask_*``, ``epsilon_*``, ``delta``, ``sdpo_token_clip``,
    ``adv_tau``, ``kl_tau``) are read from composer_core; ``alpha_sdpo`` and ``beta_replay`` default to 0 here on
    purpose (PRIME-RL's default loss, and channel 3 cannot run per sample).
    """

    policy_loss: PolicyLoss = "dppo"
    dppo_mask_low: float = typing.cast(float, _CORE["dppo_mask_low"])
    dppo_mask_high: float = typing.cast(float, _CORE["dppo_mask_high"])
    adv_tau: float = typing.cast(float, _DPPO["adv_tau"])
    kl_tau: float = typing.cast(float, _DPPO["kl_tau"])
    epsilon_low: float = typing.cast(float, _CORE["epsilon_low"])
    epsilon_high: float | None = typing.cast("float | None", _CORE["epsilon_high"])
    delta: float | None = typing.cast("float | None", _CORE["delta"])
    alpha_sdpo: float = 0.0
    sdpo_form: Literal["sampled"] = "sampled"
    sdpo_token_clip: float | None = typing.cast("float | None", _CORE["sdpo_token_clip"])
    sdpo_missing: Literal["error", "skip"] = "error"
    beta_replay: float = 0.0


_DEFAULTS = {f.name: f.default for f in fields(PrimeRLLossOptions)}
_DPPO_ONLY = frozenset({"dppo_mask_low", "dppo_mask_high", "adv_tau", "kl_tau"})
_SURROGATE_ONLY = frozenset({"epsilon_low", "epsilon_high", "delta"})
_SDPO_ONLY = frozenset({"sdpo_form", "sdpo_token_clip", "sdpo_missing"})

_FULL_VOCAB = (
    "PRIME-RL passes only the log-prob of each sampled token (LossInputs has no logits), so "
    "the {what} cannot be computed inside a PRIME-RL loss. Use the sampled-token form "
    '(alpha_sdpo > 0 with the default sdpo_form = "sampled"), or a host that exposes logits '
    "(composer-trl, composer-verl)."
)
_PER_TOKEN_SUM = (
    "PRIME-RL sums each sample's per-token loss and divides by the global rl-token count "
    'itself (token-level, like composer\'s loss_type = "dapo" with a global normalizer); '
    "a per-sample loss cannot choose another aggregation. Remove '{key}'."
)
_CHANNEL3 = (
    "Channel 3 (trace-replay preference, DPO/SimPO) cannot be expressed in a PRIME-RL loss: "
    "PRIME-RL calls the loss once per sample, and a preference pair needs the summed "
    "log-probs of two different sequences (chosen and rejected) in one call. Fold the pairs "
    "into the data instead: ship each winning teacher trace as its own sample (for example "
    "as ce/SFT tokens, or re-scored by the live policy and placed in the GRPO group next to "
    "the student's rollout with a higher reward, so its advantage ranks it above the "
    "student's), and keep beta_replay = 0 here. '{key}' was given."
)
_ROLLOUT = (
    "composer_prime_rl handles the trainer/inference mismatch through the selected "
    "policy_loss itself (DPPO probability masks, or the clipped ratio against "
    "inference_logprobs); '{key}' is a composer_core.compose_loss option that is not "
    "available here."
)
_KL = (
    "In PRIME-RL, ref_logprobs carry the hinted self-teacher of channel 2, not a "
    "reference policy, so a KL-to-reference penalty ('{key}') is not offered. Use "
    "kl_tau (squared log-ratio to the inference policy) or PRIME-RL's own ref_kl "
    "component (algorithms opd / opsd)."
)
_CHECKS = (
    "composer_prime_rl checks each sample's values in its own single fused read; '{key}' is a "
    "composer_core.compose_loss option that is not available here."
)


def _reason(key: str) -> str | None:
    """Why a composer_core option cannot be used here (derived from core's config classes), or None."""
    prefixes = {
        "taid_": (TAID, _FULL_VOCAB.format(what="TAID / entropy-aware (EOPD) SDPO wrapper")),
        "entropy_opd_": (EntropyOPD, _FULL_VOCAB.format(what="TAID / entropy-aware (EOPD) SDPO wrapper")),
        "dpo_": (DPO, _CHANNEL3),
        "simpo_": (SimPO, _CHANNEL3),
        "sdpo_": (SDPOOptions, _FULL_VOCAB.format(what="full-vocabulary / top-k SDPO divergence")),
    }
    if key == "sdpo_wrapper":
        return _FULL_VOCAB.format(what="TAID / entropy-aware (EOPD) SDPO wrapper")
    for prefix, (klass, reason) in prefixes.items():
        if key.startswith(prefix) and key[len(prefix) :] in {f.name for f in fields(klass)}:
            return reason
    special = {
        "sdpo_wrapper": _FULL_VOCAB.format(what="TAID / entropy-aware (EOPD) SDPO wrapper"),
        "dpo_variant": _CHANNEL3,
        "replay_normalizer": _CHANNEL3,
        "normalizer": _PER_TOKEN_SUM,
        "sdpo_normalizer": _PER_TOKEN_SUM,
        "check_values": _CHECKS,
    }
    if key in special:
        return special[key]
    if key in {f.name for f in fields(PolicyOptions)}:
        if key.startswith("rollout_"):
            return _ROLLOUT
        if key.startswith("kl_"):
            return _KL
        return _PER_TOKEN_SUM  # loss_type, max_completion_length
    return None


#: composer_core options that cannot work per sample, each with the reason (no hand-written table: every core
#: option that is not one of PrimeRLLossOptions' fields is here).
_UNSUPPORTED: dict[str, str] = {
    key: reason
    for key in flat_option_names()
    if key not in _DEFAULTS and (reason := _reason(key)) is not None
}


def valid_option_names() -> tuple[str, ...]:
    """The keys ``[trainer.loss.kwargs]`` accepts, in declaration order."""
    return tuple(f.name for f in fields(PrimeRLLossOptions))


def _number(key: str, value: Any, *, minimum: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"'{key}' must be a number, got {value!r} ({type(value).__name__}).")
    out = float(value)
    if not math.isfinite(out) or out < minimum or (strict and out == minimum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise ValueError(f"'{key}' must be a finite number {bound}, got {value!r}.")
    return out


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"'{key}' must be one of {', '.join(map(repr, allowed))}, got {value!r}.")
    return str(value)


_HINTS = typing.get_type_hints(PrimeRLLossOptions)


def _coerce(key: str, value: Any) -> Any:
    """CLI strings (``--loss.kwargs.alpha_sdpo 0.25`` arrives as ``'0.25'``) → the option's type, with the
    coercion of composer_core's typed config; ``sdpo_token_clip = false`` (TOML has no null) → None."""
    if key == "sdpo_token_clip" and (
        value is False or (isinstance(value, str) and value.strip().lower() == "false")
    ):
        return None
    if not isinstance(value, str) or typing.get_origin(_HINTS[key]) is Literal:
        return value  # typed values (TOML numbers, Python kwargs) and choices are judged by the checks below
    try:
        return coerce_to(key, value, _HINTS[key])
    except ValueError:
        want = (
            "a number" if _HINTS[key] in (float, float | None) else f"one of {typing.get_args(_HINTS[key])}"
        )
        raise ValueError(
            f"'{key}' must be {want}, got {value!r} (a string that does not convert); fix the value in "
            "[trainer.loss.kwargs] or on the command line."
        ) from None


def _build(items: tuple[tuple[str, Any], ...]) -> PrimeRLLossOptions:
    given = dict(items)
    valid = valid_option_names()
    for key in given:
        if key in _UNSUPPORTED:
            raise ValueError(_UNSUPPORTED[key].format(key=key))
        if key not in valid:
            raise ValueError(
                f"Unknown option '{key}' in [trainer.loss.kwargs] for "
                f"composer_prime_rl.composer_loss. Valid options: {', '.join(valid)}."
            )
    given = {key: _coerce(key, value) for key, value in given.items()}

    policy = _choice("policy_loss", given.get("policy_loss", "dppo"), ("dppo", "clipped_surrogate"))
    stray = (_SURROGATE_ONLY if policy == "dppo" else _DPPO_ONLY) & given.keys()
    if stray:
        names = ", ".join(sorted(stray))
        raise ValueError(
            f"{names} only apply to the other policy loss, but policy_loss = {policy!r}; "
            f"remove {names} or change policy_loss."
        )

    form = given.get("sdpo_form", "sampled")
    if form in ("full", "topk", "fused"):
        raise ValueError(_FULL_VOCAB.format(what=f"sdpo_form = {form!r}"))
    # "auto" is compose_loss's choice among the forms whose inputs exist: here only "sampled".
    _choice("sdpo_form", form, ("sampled", "auto"))

    # composer_core checks the options it shares with this adapter (its message names the option): channel
    # weights and sdpo_token_clip through its ComposeConfig, the clip arguments with clipped_surrogate's check.
    sdpo = {k: given[k] for k in ("alpha_sdpo", "sdpo_token_clip") if k in given}
    core = ComposeConfig.from_flat(beta_replay=given.get("beta_replay", 0.0), sdpo_form="sampled", **sdpo)
    if core.beta_replay != 0.0:
        raise ValueError(_CHANNEL3.format(key="beta_replay"))
    alpha = core.alpha_sdpo if "alpha_sdpo" in given else typing.cast(float, _DEFAULTS["alpha_sdpo"])
    if alpha == 0.0 and _SDPO_ONLY & given.keys():
        names = ", ".join(sorted(_SDPO_ONLY & given.keys()))
        raise ValueError(
            f"{names} configure channel 2, which is off (alpha_sdpo = 0); set alpha_sdpo > 0 "
            f"or remove {names}."
        )
    clip = {k: given.get(k, _DEFAULTS[k]) for k in ("epsilon_low", "epsilon_high", "delta")}
    clip = {k: None if v is None else coerce_to(k, v, _HINTS[k]) for k, v in clip.items()}
    check_clip_args(clip["epsilon_low"], clip["epsilon_high"], clip["delta"])

    return PrimeRLLossOptions(
        policy_loss=policy,  # type: ignore[arg-type]
        dppo_mask_low=_number("dppo_mask_low", given.get("dppo_mask_low", _DEFAULTS["dppo_mask_low"])),
        dppo_mask_high=_number("dppo_mask_high", given.get("dppo_mask_high", _DEFAULTS["dppo_mask_high"])),
        adv_tau=_number("adv_tau", given.get("adv_tau", _DEFAULTS["adv_tau"])),
        kl_tau=_number("kl_tau", given.get("kl_tau", _DEFAULTS["kl_tau"])),
        epsilon_low=clip["epsilon_low"],
        epsilon_high=clip["epsilon_high"],
        delta=clip["delta"],
        alpha_sdpo=alpha,
        sdpo_form="sampled",
        sdpo_token_clip=core.sdpo.token_clip,
        sdpo_missing=_choice("sdpo_missing", given.get("sdpo_missing", "error"), ("error", "skip")),  # type: ignore[arg-type]
        beta_replay=0.0,
    )


_build_cached = lru_cache(maxsize=64)(_build)


def parse_options(kwargs: dict[str, Any]) -> PrimeRLLossOptions:
    """Validate ``[trainer.loss.kwargs]`` into :class:`PrimeRLLossOptions`.

    The result is cached per distinct kwargs (the trainer passes the same dict on every
    per-sample call), so validation costs a dictionary lookup after the first sample.

    Raises:
        ValueError: unknown option (lists the valid ones), an option that cannot work in a
            per-sample PRIME-RL loss (says why and what to do), an option of the policy
            loss that is not selected, or a bad value.
    """
    items = tuple(sorted(kwargs.items()))
    try:
        return _build_cached(items)
    except TypeError:  # an unhashable value (a list from TOML): validate uncached
        return _build(items)
