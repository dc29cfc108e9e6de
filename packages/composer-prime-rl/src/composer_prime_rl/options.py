"""The ``[trainer.loss.kwargs]`` table of ``composer_loss``, validated.

PRIME-RL forwards ``CustomLossConfig.kwargs`` verbatim on every per-sample call, so a typo or an option that
cannot work per sample would otherwise be silently ignored. :func:`parse_options` turns the kwargs into a frozen
:class:`PrimeRLLossOptions` and raises ``ValueError`` for anything it cannot honour, naming the option and the fix.
"""

from __future__ import annotations

import inspect
import math
import typing
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Literal

from composer_core import ComposeConfig, PolicyOptions, SDPOOptions, dppo_loss
from composer_core.loss.config import coerce_to, flat_option_names

__all__ = ["PrimeRLLossOptions", "parse_options", "valid_option_names"]

PolicyLoss = Literal["dppo", "clipped_surrogate"]

#: dppo_loss's defaults (PRIME-RL's DefaultLossConfig), the one source of truth for adv_tau / kl_tau.
_DPPO = {name: p.default for name, p in inspect.signature(dppo_loss).parameters.items()}


@dataclass(frozen=True)
class PrimeRLLossOptions:
    """Options of ``composer_prime_rl.composer_loss`` (keys of ``[trainer.loss.kwargs]``; the README's table).

    Channel 1, ``policy_loss``: ``"dppo"`` (default; PRIME-RL's own default rl loss, options ``dppo_mask_low``,
    ``dppo_mask_high``, ``adv_tau``, ``kl_tau`` with its names and defaults) or ``"clipped_surrogate"`` (PPO/GRPO
    against ``inference_logprobs``; ``epsilon_low``, ``epsilon_high``, ``delta``), weighted by ``w_policy`` (core's
    default 1; 0 = pure self-distillation: the policy term adds nothing to the loss or its gradient, though its
    per-token diagnostics are still computed for PRIME-RL's metrics). Channel 2, ``alpha_sdpo > 0``:
    the per-sample ``ref_logprobs`` are the teacher of the sampled-token form (``sdpo_form``: ``"sampled"``, or
    ``"auto"``, which can only pick it); ``sdpo_token_clip`` caps the importance weight (None / ``false``: no
    weight); ``sdpo_missing``: a sample without ``ref_logprobs`` raises (``"error"``) or trains on channel 1 only
    (``"skip"``). Channel 3, ``beta_replay``, only accepts 0. Shared defaults are composer_core's, except
    ``alpha_sdpo`` and ``beta_replay`` (0 here).
    """

    policy_loss: PolicyLoss = "dppo"
    dppo_mask_low: float = PolicyOptions.dppo_mask_low
    dppo_mask_high: float = PolicyOptions.dppo_mask_high
    adv_tau: float = typing.cast(float, _DPPO["adv_tau"])
    kl_tau: float = typing.cast(float, _DPPO["kl_tau"])
    epsilon_low: float = PolicyOptions.epsilon_low
    epsilon_high: float | None = PolicyOptions.epsilon_high
    delta: float | None = PolicyOptions.delta
    w_policy: float = ComposeConfig.w_policy
    alpha_sdpo: float = 0.0
    sdpo_form: Literal["sampled"] = "sampled"
    sdpo_token_clip: float | None = SDPOOptions.token_clip
    sdpo_missing: Literal["error", "skip"] = "error"
    beta_replay: float = 0.0


_DEFAULTS = {f.name: f.default for f in fields(PrimeRLLossOptions)}
_HINTS = typing.get_type_hints(PrimeRLLossOptions)
_CHOICES = {
    "policy_loss": ("dppo", "clipped_surrogate"),
    "sdpo_form": ("sampled", "auto"),
    "sdpo_missing": ("error", "skip"),
}
#: the adapter's own numbers (PRIME-RL's ranges: any finite value >= 0; core's dppo bounds stop at 1)
_OWN_NUMBERS = frozenset({"dppo_mask_low", "dppo_mask_high", "adv_tau", "kl_tau"})
#: the options composer_core's ComposeConfig checks (its message names the option)
_CORE_CHECKED = (
    "w_policy",
    "alpha_sdpo",
    "beta_replay",
    "sdpo_token_clip",
    "epsilon_low",
    "epsilon_high",
    "delta",
)
_OTHER_POLICY = {
    "dppo": frozenset({"epsilon_low", "epsilon_high", "delta"}),
    "clipped_surrogate": _OWN_NUMBERS,
}
_SDPO_ONLY = frozenset({"sdpo_form", "sdpo_token_clip", "sdpo_missing"})

_FULL_VOCAB = (
    "PRIME-RL passes only the log-prob of each sampled token (LossInputs has no logits), so "
    "the {what} cannot be computed inside a PRIME-RL loss. Use the sampled-token form "
    '(alpha_sdpo > 0 with the default sdpo_form = "sampled"), or a host that exposes logits '
    "(composer-trl, composer-verl)."
)
_WRAPPER = _FULL_VOCAB.format(what="TAID / entropy-aware (EOPD) SDPO wrapper")
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
_NOT_HERE = "'{key}' is a composer_core.compose_loss option that is not available here."
_ROLLOUT = (
    "composer_prime_rl handles the trainer/inference mismatch through the selected "
    "policy_loss itself (DPPO probability masks, or the clipped ratio against "
    "inference_logprobs); " + _NOT_HERE
)
_KL = (
    "In PRIME-RL, ref_logprobs carry the hinted self-teacher of channel 2, not a "
    "reference policy, so a KL-to-reference penalty ('{key}') is not offered. Use "
    "kl_tau (squared log-ratio to the inference policy) or PRIME-RL's own ref_kl "
    "component (algorithms opd / opsd)."
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
#: every composer_core option that is not one of PrimeRLLossOptions' fields, with the reason it is refused
_UNSUPPORTED: dict[str, str] = {
    key: next(reason for prefix, reason in _REASONS if key.startswith(prefix))
    for key in flat_option_names()
    if key not in _DEFAULTS
}


def valid_option_names() -> tuple[str, ...]:
    """The keys ``[trainer.loss.kwargs]`` accepts, in declaration order."""
    return tuple(_DEFAULTS)


def _coerce(key: str, value: Any) -> Any:
    """One option's value checked against its choices, or converted to its type with composer_core's
    ``coerce_to`` (CLI strings: ``--loss.kwargs.alpha_sdpo 0.25`` arrives as ``'0.25'``); ``sdpo_token_clip =
    false`` (TOML has no null) → None. Typed values of the options core checks are left to core."""
    if key in _CHOICES:
        if key == "sdpo_form" and value in ("full", "topk", "fused"):
            raise ValueError(_FULL_VOCAB.format(what=f"sdpo_form = {value!r}"))
        if value not in _CHOICES[key]:  # sdpo_form "auto" can only pick "sampled" here
            raise ValueError(f"'{key}' must be one of {', '.join(map(repr, _CHOICES[key]))}, got {value!r}.")
        return value
    if key == "sdpo_token_clip" and isinstance(value, bool | str) and str(value).strip().lower() == "false":
        return None
    if key not in _OWN_NUMBERS and not isinstance(value, str):
        return value
    try:
        out = coerce_to(key, value, _HINTS[key])
    except ValueError:
        raise ValueError(
            f"'{key}' must be a number, got {value!r} ({type(value).__name__}); fix the value in "
            "[trainer.loss.kwargs] or on the command line."
        ) from None
    if key in _OWN_NUMBERS and not 0.0 <= typing.cast(float, out) < math.inf:
        raise ValueError(f"'{key}' must be a finite number >= 0, got {value!r}.")
    return out


def _build(items: tuple[tuple[str, type, Any], ...]) -> PrimeRLLossOptions:
    for key, _, _ in items:
        if key in _UNSUPPORTED:
            raise ValueError(_UNSUPPORTED[key].format(key=key))
        if key not in _DEFAULTS:
            raise ValueError(
                f"Unknown option '{key}' in [trainer.loss.kwargs] for "
                f"composer_prime_rl.composer_loss. Valid options: {', '.join(_DEFAULTS)}."
            )
    given = {key: _coerce(key, value) for key, _, value in items}
    opts = {**_DEFAULTS, **given}
    policy = opts["policy_loss"]
    if stray := ", ".join(sorted(_OTHER_POLICY[policy] & given.keys())):
        raise ValueError(
            f"{stray} only apply to the other policy loss, but policy_loss = {policy!r}; "
            f"remove {stray} or change policy_loss."
        )
    # composer_core checks the options it shares with this adapter, its message naming the option
    core = ComposeConfig.from_flat(**{k: opts[k] for k in _CORE_CHECKED}, sdpo_form="sampled")
    if core.beta_replay != 0.0:
        raise ValueError(_CHANNEL3.format(key="beta_replay"))
    if core.alpha_sdpo == 0.0 and (stray := ", ".join(sorted(_SDPO_ONLY & given.keys()))):
        raise ValueError(
            f"{stray} configure channel 2, which is off (alpha_sdpo = 0); set alpha_sdpo > 0 or remove {stray}."
        )
    core_values = {
        "sdpo_token_clip": core.sdpo.token_clip,
        "alpha_sdpo": core.alpha_sdpo,
        "w_policy": core.w_policy,
    }
    core_values |= {k: getattr(core.policy, k) for k in ("epsilon_low", "epsilon_high", "delta")}
    return PrimeRLLossOptions(**{**opts, **core_values, "sdpo_form": "sampled"})


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
