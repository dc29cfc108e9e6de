"""The ``[trainer.loss.kwargs]`` table of ``composer_loss``, validated into composer_core's typed options.

PRIME-RL forwards ``CustomLossConfig.kwargs`` verbatim on every per-sample call, so a typo or an option that
cannot work per sample would otherwise be silently ignored. :func:`parse_options` turns the kwargs into a frozen
:class:`PrimeRLLossOptions`: composer_core's :class:`~composer_core.ComposeConfig` (the options shared with core,
coerced, defaulted and checked there) and the few only PRIME-RL has. It raises ``ValueError`` for anything it
cannot honour, naming the option and the fix.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any, Literal

from composer_core import ComposeConfig, dppo_loss
from composer_core.loss.config import coerce_option, coerce_to, flat_option_names
from composer_core.loss.validation import check_number

__all__ = ["PrimeRLLossOptions", "parse_options", "valid_option_names"]

PolicyLoss = Literal["dppo", "clipped_surrogate"]

#: dppo_loss's defaults (PRIME-RL's DefaultLossConfig), the one source of truth for adv_tau / kl_tau.
_DPPO = {name: p.default for name, p in inspect.signature(dppo_loss).parameters.items()}


def _core(policy_loss: str = "dppo", **flat: Any) -> ComposeConfig:
    """composer_core's typed options from their flat names: DPPO's probability masks are core's
    ``rollout_correction = "dppo_mask"``; channel 2's options are judged in the sampled-token form, the one a batch
    of log-probs resolves to."""
    mode: dict[str, Any] = {"rollout_correction": "dppo_mask"} if policy_loss == "dppo" else {}
    return ComposeConfig.from_flat(**flat, **mode, has_logits=False, has_hidden=False, has_sampled=True)


@dataclass(frozen=True)
class PrimeRLLossOptions:
    """Options of ``composer_prime_rl.composer_loss`` (keys of ``[trainer.loss.kwargs]``; the README's table).

    ``config``: composer_core's typed options, with core's names, defaults and checks: the channel weights
    ``w_policy``, ``alpha_sdpo``, ``beta_replay`` (only 0 here: channel 3 has no per-sample form), the policy's
    ``epsilon_low``, ``epsilon_high``, ``delta`` (``"clipped_surrogate"``) or ``dppo_mask_low``, ``dppo_mask_high``
    (``"dppo"``, core's ``rollout_correction = "dppo_mask"``; a bound above 1 masks nothing and reads as 1), and
    channel 2's ``sdpo_token_clip`` (``false``: no importance weight) in the sampled-token form (``sdpo_form``:
    ``"sampled"``, or ``"auto"``, which can only pick it). PRIME-RL's own: ``policy_loss`` (``"dppo"``, PRIME-RL's
    default rl loss with its ``adv_tau`` and ``kl_tau``, or ``"clipped_surrogate"`` against ``inference_logprobs``)
    and ``sdpo_missing`` (a sample without ``ref_logprobs`` raises, ``"error"``, or trains on channel 1 only,
    ``"skip"``).
    """

    config: ComposeConfig = field(default_factory=_core)
    policy_loss: PolicyLoss = "dppo"
    adv_tau: float = typing.cast(float, _DPPO["adv_tau"])
    kl_tau: float = typing.cast(float, _DPPO["kl_tau"])
    sdpo_missing: Literal["error", "skip"] = "error"


_OWN = {f.name: f.default for f in fields(PrimeRLLossOptions) if f.name != "config"}
_HINTS = typing.get_type_hints(PrimeRLLossOptions)
#: every key [trainer.loss.kwargs] accepts, in the README's order (the others are core's flat names)
_OPTIONS = (
    "policy_loss", "dppo_mask_low", "dppo_mask_high", "adv_tau", "kl_tau", "epsilon_low", "epsilon_high", "delta",
    "w_policy", "alpha_sdpo", "sdpo_form", "sdpo_token_clip", "sdpo_missing", "beta_replay",
)  # fmt: skip
_OTHER_POLICY = {
    "dppo": frozenset({"epsilon_low", "epsilon_high", "delta"}),
    "clipped_surrogate": frozenset({"dppo_mask_low", "dppo_mask_high", "adv_tau", "kl_tau"}),
}
_SDPO_ONLY = frozenset({"sdpo_form", "sdpo_token_clip", "sdpo_missing"})

_FULL_VOCAB = (
    "PRIME-RL passes only the log-prob of each sampled token (LossInputs has no logits), so the {what} cannot be "
    "computed inside a PRIME-RL loss. Use the sampled-token form (alpha_sdpo > 0 with the default sdpo_form = "
    '"sampled"), or a host that exposes logits (composer-trl, composer-verl).'
)
_WRAPPER = _FULL_VOCAB.format(what="TAID / entropy-aware (EOPD) SDPO wrapper")
_PER_TOKEN_SUM = (
    "PRIME-RL sums each sample's per-token loss and divides by the global rl-token count itself (token-level, like "
    'composer\'s loss_type = "dapo" with a global normalizer); a per-sample loss cannot choose another '
    "aggregation. Remove '{key}'."
)
_CHANNEL3 = (
    "Channel 3 (trace-replay preference, DPO/SimPO) cannot be expressed in a PRIME-RL loss: PRIME-RL calls the "
    "loss once per sample, and a preference pair needs the summed log-probs of two different sequences (chosen "
    "and rejected) in one call. Fold the pairs into the data instead: ship each winning teacher trace as its own "
    "sample (for example as ce/SFT tokens, or re-scored by the live policy and placed in the GRPO group next to "
    "the student's rollout with a higher reward, so its advantage ranks it above the student's), and keep "
    "beta_replay = 0 here. '{key}' was given."
)
_NOT_HERE = "'{key}' is a composer_core.compose_loss option that is not available here."
_ROLLOUT = (
    "composer_prime_rl handles the trainer/inference mismatch through the selected policy_loss itself (DPPO "
    "probability masks, or the clipped ratio against inference_logprobs); " + _NOT_HERE
)
_KL = (
    "In PRIME-RL, ref_logprobs carry the hinted self-teacher of channel 2, not a reference policy, so a "
    "KL-to-reference penalty ('{key}') is not offered. Use kl_tau (squared log-ratio to the inference policy) or "
    "PRIME-RL's own ref_kl component (algorithms opd / opsd)."
)
_CHECKS = "composer_prime_rl checks each sample's values in its own single fused read; " + _NOT_HERE

#: why a composer_core option cannot work per sample, by core's flat-name prefix (the first match wins;
#: "" is the rest of PolicyOptions: loss_type, max_completion_length, importance_sampling_level, sapo_*, ...)
_REASONS = (
    ("check_values", _CHECKS),
    ("normalizer", _PER_TOKEN_SUM),
    ("sdpo_normalizer", _PER_TOKEN_SUM),
    ("replay_normalizer", _CHANNEL3),
    ("sdpo_wrapper", _WRAPPER),
    ("taid_", _WRAPPER),
    ("entropy_opd_", _WRAPPER),
    ("dpo_", _CHANNEL3),
    ("simpo_", _CHANNEL3),
    ("rpo_alpha", _CHANNEL3),
    ("sdpo_", _FULL_VOCAB.format(what="full-vocabulary / top-k SDPO divergence")),
    ("rollout_", _ROLLOUT),
    ("kl_", _KL),
    ("", _PER_TOKEN_SUM),
)
#: every composer_core option that is not one of _OPTIONS, with the reason it is refused
_UNSUPPORTED: dict[str, str] = {
    key: next(reason for prefix, reason in _REASONS if key.startswith(prefix))
    for key in flat_option_names()
    if key not in _OPTIONS
}


def valid_option_names() -> tuple[str, ...]:
    """The keys ``[trainer.loss.kwargs]`` accepts."""
    return _OPTIONS


def _own(key: str, value: Any) -> Any:
    """One PRIME-RL option coerced to its type with composer_core's ``coerce_to`` (CLI strings: ``--loss.kwargs.kl_tau
    0`` arrives as ``'0'``); DPPO's taus are finite and >= 0, as PRIME-RL's config has them."""
    out = coerce_to(key, value, _HINTS[key])
    return check_number(key, typing.cast(float, out), low=0.0) if key in ("adv_tau", "kl_tau") else out


def _shared(key: str, value: Any) -> Any:
    """One core option as core reads it, but for PRIME-RL's spellings: ``sdpo_token_clip = false`` (TOML has no
    null) is None, and a DPPO mask bound above 1 is 1 (|Δp| < 1: neither masks a token)."""
    if key == "sdpo_token_clip" and str(value).strip().lower() == "false":
        return None
    if key == "sdpo_form":
        if str(value).strip() in ("full", "topk", "fused"):
            raise ValueError(_FULL_VOCAB.format(what=f"sdpo_form = {value!r}"))
        return coerce_to(key, value, Literal["sampled", "auto"])
    if key in ("dppo_mask_low", "dppo_mask_high"):
        return min(typing.cast(float, coerce_option(key, value)), 1.0)
    return value


def _build(items: tuple[tuple[str, type, Any], ...]) -> PrimeRLLossOptions:
    for key, _, _ in items:
        if key in _UNSUPPORTED:
            raise ValueError(_UNSUPPORTED[key].format(key=key))
        if key not in _OPTIONS:
            raise ValueError(
                f"Unknown option '{key}' in [trainer.loss.kwargs] for "
                f"composer_prime_rl.composer_loss. Valid options: {', '.join(_OPTIONS)}."
            )
    own = {key: _own(key, value) for key, _, value in items if key in _OWN}
    policy = own.get("policy_loss", _OWN["policy_loss"])
    if stray := ", ".join(sorted(_OTHER_POLICY[policy] & {key for key, _, _ in items})):
        raise ValueError(
            f"{stray} only apply to the other policy loss, but policy_loss = {policy!r}; "
            f"remove {stray} or change policy_loss."
        )
    shared = {key: _shared(key, value) for key, _, value in items if key not in _OWN}
    config = _core(policy, **shared)  # core coerces and checks them, its message naming the option
    if config.beta_replay != 0.0:
        raise ValueError(_CHANNEL3.format(key="beta_replay"))
    given = {key for key, _, _ in items}
    if config.alpha_sdpo == 0.0 and (stray := ", ".join(sorted(_SDPO_ONLY & given))):
        raise ValueError(
            f"{stray} configure channel 2, which is off (alpha_sdpo = 0); set alpha_sdpo > 0 or remove {stray}."
        )
    return PrimeRLLossOptions(config=config, **own)


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
    # the type joins the key: 1.0 and True hash alike but do not validate alike
    items = tuple(sorted((key, type(value), value) for key, value in kwargs.items()))
    try:
        return _build_cached(items)
    except TypeError:  # an unhashable value (a list from TOML): validate uncached
        return _build(items)
