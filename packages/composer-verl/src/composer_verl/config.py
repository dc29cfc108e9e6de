"""The plugin-owned configuration section of composer-verl.

verl's ``PolicyLossConfig`` and ``AlgoConfig`` are closed dataclasses: an unknown key such as
``+actor_rollout_ref.actor.policy_loss.alpha_sdpo=0.5`` raises ``TypeError``. composer's own
hyper-parameters therefore live in this section, read from the environment variable
``COMPOSER_VERL_CONFIG`` in every process that needs them (the driver computing advantages and
the actor workers computing the loss):

* inline JSON: ``COMPOSER_VERL_CONFIG='{"alpha_sdpo": 0.5, "adv_scale": "none"}'``
* or a path to a ``.json`` / ``.yaml`` / ``.yml`` file holding the same mapping.

Forward it to verl's Ray workers with
``+ray_kwargs.ray_init.runtime_env.env_vars.COMPOSER_VERL_CONFIG=...`` (``run_ppo`` merges it into
the runtime environment of every actor). In one process (tests, notebooks) :func:`configure`
sets it programmatically and takes precedence over the environment.

Everything verl already has a key for stays in verl's config and is read from there:
``clip_ratio_low/high``, ``clip_ratio_c``, ``loss_agg_mode``, ``loss_scale_factor``,
``algorithm.norm_adv_by_std_in_grpo``, ``use_kl_loss``/``kl_loss_coef``, ``entropy_coeff``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, cast

from composer_core.loss.config import ComposeConfig, coerce_option, flat_defaults
from composer_core.sdpo import TeacherWeightsOptions

ENV_VAR = "COMPOSER_VERL_CONFIG"

#: composer_core's defaults, the one source of truth for the options this section shares with core.
_CORE = flat_defaults()
_TEACHER = {f.name: f.default for f in fields(TeacherWeightsOptions)}

_CHOICES: dict[str, tuple[Any, ...]] = {
    "adv_scale": (None, "group", "batch", "none"),
    "adv_singleton": ("reward", "zero"),
    "sdpo_form": ("sampled", "topk"),  # verl's subset of core's forms (core checks the value itself)
}
#: the options this section passes to composer_core's ComposeConfig, which checks them (under core's flat names)
_SHARED = (
    "alpha_sdpo",
    "beta_replay",
    "sdpo_form",
    "sdpo_token_clip",
    "sdpo_topk",
    "sdpo_topk_tail",
    "sdpo_beta",
    "dpo_variant",
    "dpo_beta",
    "dpo_loss_type",
    "dpo_label_smoothing",
    "simpo_beta",
    "simpo_gamma",
)


@dataclass(frozen=True)
class ComposerVerlConfig:
    """composer's options that verl's config has no key for.

    Advantage estimator ``grpo_composer`` (driver side):
        adv_scale: ``"group"`` (GRPO, std of the group), ``"batch"`` (std of the whole batch, TRL
            ``scale_rewards="batch"``), ``"none"`` (Dr. GRPO, ``r - mean_g``). ``None`` follows verl's
            ``algorithm.norm_adv_by_std_in_grpo`` (True -> ``"group"``, False -> ``"none"``).
        adv_eps: ε in ``(r - mean)/(std + ε)``; verl's GRPO uses 1e-6.
        adv_singleton: a group of one completion gets ``A = r`` (``"reward"``, verl: mean 0, std 1)
            or ``A = 0`` (``"zero"``, TRL).

    Policy loss ``composer`` channel 1 (actor side):
        policy_delta: optional cap δ on the ratio in the unclipped branch (TRL/INTELLECT-2 two-sided
            clipping); choose ``delta > 1 + clip_ratio_high``. ``None`` = verl's vanilla surrogate.

    Channel 2, SDPO on the sampled tokens (needs the composer actor extension):
        alpha_sdpo: weight α of the distillation term; 0 disables it (not computed at all).
        sdpo_token_clip: clip of the detached importance weight ``min(exp(ℓθ-ℓold), clip)``
            (TRL ``distillation_is_clip``); ``None`` = no clip.

        sdpo_form: ``sampled`` (the sampled-token estimator, default) or ``topk``: the generalized JSD (β =
            ``sdpo_beta``) on the student's top-``sdpo_topk`` tokens, plus the tail bucket ``1 − Σ_k p`` when
            ``sdpo_topk_tail`` (composer_core's ``topk_distill``, TRL SDPOTrainer's / lasgroup/SDPO's top-k form);
            computed in the actor's training forward through verl's logits hook, with the live teacher only.
        sdpo_teacher: whose weights score the teacher contexts (``trainer_mode=composer_sync``): ``live`` (the
            actor's current weights, verl's ``compute_log_prob``), ``base`` (a frozen copy of the initial weights)
            or ``ema`` (``θT ← (1−τ)θT + τθS`` after every ``teacher_sync_steps`` optimizer steps, τ =
            ``teacher_update_rate``), held by the actor worker (composer_core's ``TeacherWeightsOptions``).

    Channel 3, trace-replay preference (needs the composer actor extension):
        beta_replay: weight β of the preference term; 0 disables it.
        dpo_variant: ``"dpo"`` (needs reference log-probs) or ``"simpo"`` (length-normalised, no ref).
        dpo_beta, dpo_loss_type, dpo_label_smoothing: DPO options (TRL defaults).
        simpo_beta, simpo_gamma: SimPO options (paper defaults β=2, γ=0.5).
    """

    adv_scale: Literal["group", "batch", "none"] | None = None
    adv_eps: float = 1e-6
    adv_singleton: Literal["reward", "zero"] = "reward"
    policy_delta: float | None = cast("float | None", _CORE["delta"])
    # alpha_sdpo / beta_replay default to 0 on purpose (core: 1.0): verl runs channel 1 only unless asked
    alpha_sdpo: float = 0.0
    sdpo_token_clip: float | None = cast("float | None", _CORE["sdpo_token_clip"])
    sdpo_form: Literal["sampled", "topk"] = "sampled"
    sdpo_topk: int | None = cast("int | None", _CORE["sdpo_topk"])
    sdpo_topk_tail: bool = cast(bool, _CORE["sdpo_topk_tail"])
    sdpo_beta: float = cast(float, _CORE["sdpo_beta"])
    sdpo_teacher: Literal["live", "ema", "base"] = cast(
        Literal["live", "ema", "base"], _TEACHER["sdpo_teacher"]
    )
    teacher_update_rate: float = cast(float, _TEACHER["teacher_update_rate"])
    teacher_sync_steps: int = cast(int, _TEACHER["teacher_sync_steps"])
    beta_replay: float = 0.0
    dpo_variant: Literal["dpo", "simpo"] = cast(Literal["dpo", "simpo"], _CORE["dpo_variant"])
    dpo_beta: float = cast(float, _CORE["dpo_beta"])
    dpo_loss_type: Literal["sigmoid", "robust", "ipo"] = cast(
        Literal["sigmoid", "robust", "ipo"], _CORE["dpo_loss_type"]
    )
    dpo_label_smoothing: float = cast(float, _CORE["dpo_label_smoothing"])
    simpo_beta: float = cast(float, _CORE["simpo_beta"])
    simpo_gamma: float = cast(float, _CORE["simpo_gamma"])
    #: composer_core's typed config of channels 2 and 3, built once here (the loss reads it every step)
    compose: ComposeConfig = field(init=False, repr=False, compare=False)
    #: composer_core's teacher-weights options (sdpo_teacher, teacher_update_rate, teacher_sync_steps)
    teacher: TeacherWeightsOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Only verl's own options (and verl's subset of sdpo_form) are checked here; every option shared with
        # composer_core is coerced and range-checked by core (ComposeConfig / TeacherWeightsOptions), whose
        # message, naming the option, is wrapped once with this section's prefix.
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
            # composer_core's coercion (CLI/YAML strings) for the shared options; an option of the unselected
            # replay variant (e.g. simpo_gamma with dpo_variant='dpo') raises instead of being ignored.
            shared: dict[str, Any] = {name: coerce_option(name, getattr(self, name)) for name in _SHARED}
            compose = ComposeConfig.from_flat(**shared)
            teacher = TeacherWeightsOptions(**{name: getattr(self, name) for name in _TEACHER})
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
        object.__setattr__(self, "teacher", teacher)

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
        out.pop("teacher", None)
        return out


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
