"""``ComposeConfig``: the one typed, frozen home of every :func:`~composer_core.loss.compose.compose_loss`
option and default (the per-channel option classes, each field with its help text, are in
:mod:`composer_core.loss.options`; this module re-exports them).

The shape makes an option of an unselected mode impossible to write down::

    ComposeConfig(
        w_policy=1.0, alpha_sdpo=0.0, beta_replay=0.0,
        policy=PolicyOptions(loss_type="dapo", kl_beta=0.0, ...),
        sdpo=SDPOOptions(form="auto", beta=0.5, wrapper=None | TAID(...) | EntropyOPD(...)),
        replay=DPO(beta=0.1, ...) | SimPO(beta=2.0, gamma=0.5),
        check_values=True,
    )

``SimPO`` has no ``dpo_beta`` field, ``SDPOOptions(wrapper=None)`` no ``taid_t``: a flat keyword that belongs to
an unselected mode has nowhere to go, and :meth:`ComposeConfig.from_flat` (the flat keyword facade of
``compose_loss`` and of every adapter) raises ``ValueError`` naming it; ``sdpo_form="auto"`` is judged once
resolved against a batch (:meth:`ComposeConfig.resolve`).

``from_flat`` also coerces CLI strings to each option's type (:func:`coerce_to`); anything else is one
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

from composer_core.loss.options import (
    DPO,
    TAID,
    DPOVariant,
    EntropyOPD,
    PolicyOptions,
    ResolvedForm,
    SDPOOptions,
    SDPOWrapper,
    SimPO,
    _default,
    _opt,
    _raise_unused,
)

__all__ = [
    "DPO",
    "TAID",
    "ComposeConfig",
    "EntropyOPD",
    "PolicyOptions",
    "SDPOOptions",
    "SimPO",
    "coerce_option",
    "coerce_to",
    "flat_defaults",
    "flat_option_names",
    "option_help",
]


# ----------------------------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class ComposeConfig:
    """Everything :func:`~composer_core.loss.compose.compose_loss` needs besides the batch and the per-step
    normalisers. Build it once (directly, or with :meth:`from_flat` from the flat keyword names) and pass it
    on every call.

    ``w_policy`` / ``alpha_sdpo`` / ``beta_replay``: the channel weights of ``total = w_policy·policy +
    alpha_sdpo·sdpo + beta_replay·replay`` (finite, >= 0, not all 0; channels 2 and 3 are off by default, and
    their inputs passed to ``compose_loss`` at weight 0 raise). ``check_values`` skips the value checks under
    ``torch.compile`` either way; structural checks (shapes, dtypes, devices, options) always run and never read
    device memory.
    """

    w_policy: float = _opt(1.0, "weight of channel 1 (policy); 0: pure self-distillation, no policy term.")
    alpha_sdpo: float = _opt(0.0, "weight of channel 2 (SDPO self-distillation); 0 (default): off.")
    beta_replay: float = _opt(0.0, "weight of channel 3 (trace-replay preference); 0 (default): off.")
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    sdpo: SDPOOptions = field(default_factory=SDPOOptions)
    replay: DPO | SimPO = field(default_factory=DPO)
    check_values: bool = _opt(
        True, "value checks (finite, 0/1 masks, ...) in one host sync per call; False: none."
    )

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
        # the type joins the key: 1, 1.0 and True hash alike but do not coerce alike (True is no int option)
        items = tuple(sorted((k, (type(v).__name__, v)) for k, v in options.items()))
        flags = (has_logits, has_hidden, has_sampled)
        try:
            hash(items)
        except TypeError:  # an unhashable value (a list from TOML): build uncached
            return _from_flat.__wrapped__(items, flags)
        return _from_flat(items, flags)

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
#: mode selectors: flat name -> (default, choices, help)
_SELECTORS: dict[str, tuple[object, tuple[object, ...], str]] = {
    "sdpo_wrapper": ("none", get_args(SDPOWrapper), "'none', 'taid' (interpolated target, adaptive t, arXiv "
                     "2501.16937) or 'entropy_opd' (extra forward KL where the teacher is uncertain)."),
    "dpo_variant": ("dpo", get_args(DPOVariant), "'dpo' (reference log-probs needed) or 'simpo' (reference-free, "
                    "length-normalised)."),
}  # fmt: skip
_TOP = ("w_policy", "alpha_sdpo", "beta_replay", "check_values")
#: fields of both replay classes whose flat name has no prefix (the selected variant's class takes it)
_SHARED_REPLAY = ("rpo_alpha",)
#: per-call values of compose_loss that are not options of the config: flat name -> help
_PER_CALL_HELP = {
    "normalizer": "channel 1's global normaliser (policy_loss's count; None: the local one).",
    "sdpo_normalizer": "channel 2's global distilled-token (or row, seq_mean) count (None: the local one).",
    "replay_normalizer": "channel 3's global pair count (None: the local P).",
}
PER_CALL = tuple(_PER_CALL_HELP)


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


def flat_defaults() -> dict[str, object]:
    """The default of every flat option (read from the config classes; adapters take their defaults here)."""
    out: dict[str, object] = {name: _default(klass, fname) for name, (klass, fname, _) in _FLAT.items()}
    out.update({name: default for name, (default, _, _) in _SELECTORS.items()})
    return out


def option_help(flat_name: str) -> str:
    """The help text of a flat option (``--help`` of every adapter), declared once beside its field
    (``metadata["help"]``); ``ValueError`` for an unknown name."""
    if flat_name in _SELECTORS:
        return _SELECTORS[flat_name][2]
    if flat_name in _PER_CALL_HELP:
        return _PER_CALL_HELP[flat_name]
    _reject_unknown([] if flat_name in _FLAT else [flat_name])
    klass, fname, _ = _FLAT[flat_name]
    return str(next(f for f in dataclasses.fields(klass) if f.name == fname).metadata["help"])


# ----------------------------------------------------------------------------------------------- coercion
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null", "")


@cache
def _hints(klass: type) -> dict[str, Any]:
    return typing.get_type_hints(klass)


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
    if name in _SELECTORS:
        return coerce_to(name, value, Literal[_SELECTORS[name][1]])
    klass, fname, _ = _FLAT[name]
    return coerce_to(name, value, _hints(klass)[fname])


def coerce_to(name: str, value: object, ann: Any) -> object:
    """Coerce ``value`` to the type annotation ``ann`` (``float``, ``int``, ``bool``, ``Literal[...]`` and their
    unions with None; strings too: ``"true"/"no"/"1"``, ``"none"/"null"/""`` → None), as
    :meth:`ComposeConfig.from_flat` does; adapters use it for their own options."""
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
    for arg in (a for a in args if a is not type(None)):
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
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(value)
    return float(value.strip() if isinstance(value, str) else value)


_SCALARS: dict[Any, Any] = {bool: _to_bool, int: _to_int, float: _to_float}


# ----------------------------------------------------------------------------------------------- from_flat
def _reject_unknown(names: list[str]) -> None:
    if not names:
        return
    known = flat_option_names()
    close = {key: difflib.get_close_matches(key, known, n=1) for key in sorted(names)}
    hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for k, c in close.items()]
    raise ValueError(
        f"compose_loss() got unknown option(s) {', '.join(hints)}; see its docstring for the options."
    )


@lru_cache(maxsize=256)
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
