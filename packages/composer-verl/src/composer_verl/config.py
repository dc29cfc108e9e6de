"""The plugin-owned configuration section of composer-verl.

verl's ``PolicyLossConfig`` and ``AlgoConfig`` are closed dataclasses (an unknown key raises ``TypeError``), so
composer's own options live here, read from ``COMPOSER_VERL_CONFIG`` in every process that needs them (the driver
and the actor workers): inline JSON, or a path to a ``.json`` / ``.yaml`` / ``.yml`` file holding the same mapping.
Forward it to Ray workers with ``+ray_kwargs.ray_init.runtime_env.env_vars.COMPOSER_VERL_CONFIG=...``; in one
process :func:`configure` sets it and takes precedence. Everything verl has a key for stays in verl's config
(``clip_ratio_low/high``, ``clip_ratio_c``, ``loss_agg_mode``, ``norm_adv_by_std_in_grpo``, ...).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from composer_core.loss.config import (
    DPO,
    ComposeConfig,
    PolicyOptions,
    SDPOOptions,
    SimPO,
    coerce_option,
    flat_option_names,
)
from composer_core.sdpo import TeacherWeightsOptions

ENV_VAR = "COMPOSER_VERL_CONFIG"

_CHOICES: dict[str, tuple[Any, ...]] = {
    "adv_scale": (None, "group", "batch", "none"),
    "adv_singleton": ("reward", "zero"),
    "sdpo_form": ("sampled", "topk"),  # verl's subset of core's forms (core checks the value itself)
}


@dataclass(frozen=True)
class ComposerVerlConfig(TeacherWeightsOptions):
    """composer's options that verl's config has no key for (the README's table describes each).

    Advantage estimator ``grpo_composer`` (driver side): ``adv_scale`` (``group``, ``batch``, ``none``; ``None``
    follows verl's ``algorithm.norm_adv_by_std_in_grpo``), ``adv_eps``, ``adv_singleton`` (``reward``: a group of
    one gets ``A = r``, verl; ``zero``: ``A = 0``, TRL). Policy loss ``composer`` (actor side): ``policy_delta``
    (channel 1's cap δ of the unclipped ratio, ``> 1 + clip_ratio_high``; ``None`` = verl's vanilla surrogate);
    ``w_policy`` (channel 1's weight, core's default 1; 0 = pure self-distillation, channel 1 not computed);
    ``alpha_sdpo`` and the ``sdpo_*`` options (channel 2: ``sampled`` tokens or the ``topk`` form computed in the
    actor's training forward); ``beta_replay``, ``dpo_variant``, the ``dpo_*``/``simpo_*`` options and ``rpo_alpha`` (channel 3).

    Every option shared with composer_core has core's name (or verl's: ``policy_delta``) and core's default,
    except ``alpha_sdpo``/``beta_replay`` (0 here: verl runs channel 1 only unless asked); core checks them
    (:class:`~composer_core.loss.config.ComposeConfig`, built once as ``compose``, which the loss reads). The
    teacher-weights options (``sdpo_teacher``: ``live``, ``base`` or ``ema``; ``teacher_update_rate``,
    ``teacher_sync_steps``) are inherited from composer_core's
    :class:`~composer_core.sdpo.TeacherWeightsOptions`.
    """

    adv_scale: Literal["group", "batch", "none"] | None = None
    adv_eps: float = 1e-6
    adv_singleton: Literal["reward", "zero"] = "reward"
    policy_delta: float | None = PolicyOptions.delta
    w_policy: float = ComposeConfig.w_policy
    alpha_sdpo: float = 0.0
    sdpo_token_clip: float | None = SDPOOptions.token_clip
    sdpo_form: Literal["sampled", "topk"] = "sampled"
    sdpo_topk: int | None = SDPOOptions.topk
    sdpo_topk_tail: bool = SDPOOptions.topk_tail
    sdpo_beta: float = SDPOOptions.beta
    beta_replay: float = 0.0
    dpo_variant: Literal["dpo", "simpo"] = "dpo"
    dpo_beta: float = DPO.beta
    dpo_loss_type: Literal["sigmoid", "robust", "ipo"] = DPO.loss_type
    dpo_label_smoothing: float = DPO.label_smoothing
    simpo_beta: float = SimPO.beta
    simpo_gamma: float = SimPO.gamma
    rpo_alpha: float = DPO.rpo_alpha
    #: composer_core's typed config of channels 2 and 3, built once here (the loss reads it every step)
    compose: ComposeConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Only verl's own options (and verl's subset of sdpo_form) are checked here; every option shared with
        # composer_core is coerced and checked by core, whose message, naming the option, gets this prefix.
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"composer-verl config: {name}={getattr(self, name)!r} is not one of {allowed}."
                )
        eps = self.adv_eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0.0:
            raise ValueError(f"composer-verl config: adv_eps={eps!r} must be a finite number >= 0.")
        if self.policy_delta is not None and not self.policy_delta > 1.0:
            raise ValueError(
                f"composer-verl config: policy_delta={self.policy_delta!r} must be > 1 (choose delta > 1 + clip_ratio_high)."
            )
        try:
            # an option of the unselected replay variant (simpo_gamma with dpo_variant='dpo') raises in core
            shared: dict[str, Any] = {name: coerce_option(name, getattr(self, name)) for name in _SHARED}
            compose = ComposeConfig.from_flat(**shared)
            super().__post_init__()
        except ValueError as err:
            raise ValueError(f"composer-verl config: {err}") from None
        for name, value in shared.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "compose", compose)
        if self.sdpo_form == "topk" and self.sdpo_teacher != "live":
            raise ValueError(
                f"composer-verl config: sdpo_form='topk' with sdpo_teacher={self.sdpo_teacher!r}: the top-k form scores "
                "the teacher inside the actor's training forward, where verl 0.9's engine holds only the actor's "
                "weights; use sdpo_teacher='live' or sdpo_form='sampled'."
            )
        if self.sdpo_teacher != "live" and self.alpha_sdpo <= 0:
            raise ValueError(
                f"composer-verl config: sdpo_teacher={self.sdpo_teacher!r} acts only on channel 2, but alpha_sdpo is "
                "0: set alpha_sdpo > 0 or drop sdpo_teacher."
            )

    @property
    def teacher(self) -> TeacherWeightsOptions:
        """composer_core's teacher-weights options (this config is one)."""
        return self

    @classmethod
    def from_mapping(cls, mapping: dict[str, Any]) -> ComposerVerlConfig:
        """Build from a plain mapping; unknown keys raise ``ValueError`` listing the valid ones."""
        if not isinstance(mapping, dict):
            raise ValueError(f"composer-verl config must be a mapping, got {type(mapping).__name__}.")
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(f"composer-verl config: unknown key(s) {unknown}; valid keys: {sorted(known)}.")
        return cls(**mapping)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("compose", None)
        return out


#: the options this section passes to composer_core's ComposeConfig (its flat names; core checks them)
_SHARED = tuple(f.name for f in fields(ComposerVerlConfig) if f.name in flat_option_names())


def parse_config(raw: str) -> ComposerVerlConfig:
    """Parse the value of ``COMPOSER_VERL_CONFIG``: inline JSON or a path to a JSON/YAML file."""
    text = raw.strip()
    if not text:
        return ComposerVerlConfig()
    if text.startswith("{"):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{ENV_VAR} is not valid JSON ({e}); pass a JSON object or a file path.") from e
        return ComposerVerlConfig.from_mapping(mapping)
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"{ENV_VAR}={text!r}: not inline JSON and no such file.")
    if path.suffix in (".yaml", ".yml"):
        import yaml  # verl depends on omegaconf, which depends on PyYAML

        mapping = yaml.safe_load(path.read_text())
    elif path.suffix == ".json":
        mapping = json.loads(path.read_text())
    else:
        raise ValueError(f"{ENV_VAR}={text!r}: expected a .json, .yaml or .yml file.")
    return ComposerVerlConfig.from_mapping(mapping or {})


_override: ComposerVerlConfig | None = None
_cache: tuple[str, ComposerVerlConfig] | None = None


def configure(config: ComposerVerlConfig | dict[str, Any] | None) -> None:
    """Set (or with ``None`` clear) this process's config; takes precedence over the environment."""
    global _override
    _override = ComposerVerlConfig.from_mapping(config) if isinstance(config, dict) else config


def current_config() -> ComposerVerlConfig:
    """The active config: :func:`configure`'s value, else ``$COMPOSER_VERL_CONFIG``, else defaults."""
    global _cache
    if _override is not None:
        return _override
    raw = os.environ.get(ENV_VAR, "")
    if _cache is None or _cache[0] != raw:
        _cache = (raw, parse_config(raw))
    return _cache[1]
