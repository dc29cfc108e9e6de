"""The ``composer:`` section of verl's config (Hydra), the one place composer-verl reads its options.

verl's ``PolicyLossConfig`` and ``AlgoConfig`` are closed dataclasses, so composer's options live in a top-level
``composer:`` section (README, "Composer's options"). ``trainer_mode=composer_sync`` reads it on the driver and in
every actor worker (:func:`section_of`); in one process :func:`configure` sets it (tests, custom workers).
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from composer_core.loss.config import ComposeConfig, coerce_to
from composer_core.sdpo import TeacherContextOptions, TeacherWeightsOptions
from composer_core.traces.onpolicy import ReplayPairOptions, ReplayPairs

#: composer_core's flat options (``compose_loss``'s names, defaults, types and checks) the section accepts; every
#: other channel-1 setting is verl's own key (clip ratios, ``loss_agg_mode``, ``use_kl_loss``, ...)
CORE_OPTIONS = (
    "w_policy", "alpha_sdpo", "beta_replay", "sdpo_form", "sdpo_token_clip", "sdpo_topk", "sdpo_topk_tail",
    "sdpo_beta", "dpo_variant", "dpo_beta", "dpo_loss_type", "dpo_label_smoothing", "simpo_beta",
    "simpo_gamma", "rpo_alpha",
)  # fmt: skip
_TEACHER = tuple(f.name for f in fields(TeacherWeightsOptions))
_CONTEXT = tuple(f.name for f in fields(TeacherContextOptions))
_TYPED = ("compose", "teacher", "context")

HintFn = Callable[[str, str, float, Mapping[str, Any]], "str | None"]


@dataclass(frozen=True)
class ComposerVerlConfig:
    """The ``composer:`` section. ``compose`` (:data:`CORE_OPTIONS`), ``teacher`` and ``context`` are core's typed
    classes, built by :meth:`from_mapping` from the section's flat keys (core declares, defaults and checks them);
    the other fields are verl's own keys (the README's table).
    """

    compose: ComposeConfig = field(default_factory=ComposeConfig)
    teacher: TeacherWeightsOptions = field(default_factory=TeacherWeightsOptions)
    context: TeacherContextOptions = field(default_factory=TeacherContextOptions)
    adv_scale: Literal["group", "batch", "none"] | None = None
    adv_eps: float = 1e-6
    adv_singleton: Literal["reward", "zero"] = "reward"
    policy_delta: float | None = None
    hint_fn: str | None = None
    env: str | None = None
    hint_role: Literal["user", "system"] = "user"
    pair_source: str | None = None
    pairs_per_step: int = 1
    replay_pairs: ReplayPairs = ReplayPairOptions.replay_pairs
    #: channel 3's threshold with ``replay_pairs=on_policy`` (core's ``success_reward_threshold``)
    success_reward_threshold: float = TeacherContextOptions.success_reward_threshold

    def __post_init__(self) -> None:
        for name, ann in typing.get_type_hints(
            ComposerVerlConfig
        ).items():  # verl's own options: core's coercion
            value, args = getattr(self, name), typing.get_args(ann)
            choices = [c for a in (ann, *args) if typing.get_origin(a) is Literal for c in typing.get_args(a)]
            if name not in _TYPED and str not in (ann, *args) and value not in (None, *choices):
                object.__setattr__(self, name, coerce_to(f"composer.{name}", value, ann))
        if not self.adv_eps >= 0.0:
            raise ValueError(f"composer.adv_eps={self.adv_eps!r} must be a finite number >= 0.")
        if self.policy_delta is not None and not self.policy_delta > 1.0:
            raise ValueError(
                f"composer.policy_delta={self.policy_delta!r} must be > 1 (choose delta > 1 + clip_ratio_high)."
            )
        if self.pairs_per_step < 1:
            raise ValueError(f"composer.pairs_per_step={self.pairs_per_step!r} must be an integer >= 1.")
        if self.compose.sdpo.form not in ("auto", "sampled", "topk"):
            raise ValueError(
                f"composer.sdpo_form={self.compose.sdpo.form!r}: verl computes channel 2 as 'sampled' or 'topk'."
            )
        if self.compose.sdpo.form == "auto":  # verl's batch carries the sampled tokens only
            self.compose.resolve(has_logits=False, has_hidden=False, has_sampled=True)
        self._check_teacher()
        self._check_producers()

    @property
    def sdpo_form(self) -> Literal["sampled", "topk"]:
        """Channel 2's estimator in verl: ``topk`` (asked for) or the sampled tokens."""
        return "topk" if self.compose.sdpo.form == "topk" else "sampled"

    @property
    def hints(self) -> bool:
        """Channel 2's teacher contexts are produced (a hint function, an environment, or the group)."""
        return self.hint_fn is not None or self.env is not None or self.context.from_group

    def _check_teacher(self) -> None:
        teacher = self.teacher.sdpo_teacher
        if self.sdpo_form == "topk" and teacher != "live":
            raise ValueError(
                f"composer.sdpo_form='topk' with sdpo_teacher={teacher!r}: the top-k form scores the teacher "
                "inside the actor's training forward, where verl 0.9's engine holds only the actor's weights; use "
                "sdpo_teacher='live' or sdpo_form='sampled'."
            )
        if teacher != "live" and self.compose.alpha_sdpo <= 0:
            raise ValueError(
                f"composer.sdpo_teacher={teacher!r} acts only on channel 2, but alpha_sdpo is 0: set "
                "composer.alpha_sdpo > 0 or drop sdpo_teacher."
            )
        if teacher != "live" and not self.hints:
            raise ValueError(
                f"composer.sdpo_teacher={teacher!r} scores channel 2's teacher contexts, but the section produces "
                "none: set composer.sdpo_teacher_context (e.g. success), composer.hint_fn or composer.env, or drop it."
            )

    def _check_producers(self) -> None:
        has_text, context = (
            self.hint_fn is not None or self.env is not None,
            self.context.sdpo_teacher_context,
        )
        refusals = (
            (self.env is not None and self.hint_fn is not None,
             "composer.env and composer.hint_fn are both set: the environment's feedback is the hint, so drop one"),
            (self.hints and self.compose.alpha_sdpo <= 0,
             "composer.hint_fn / env / sdpo_teacher_context produce channel 2 but alpha_sdpo is 0: set "
             "composer.alpha_sdpo > 0"),
            (self.pair_source is not None and self.compose.beta_replay <= 0,
             "composer.pair_source is set but beta_replay is 0: set composer.beta_replay > 0"),
            (self.replay_pairs == "on_policy" and self.pair_source != "dataset",
             "composer.replay_pairs=on_policy pairs each failed response with its row's `chosen` column: set "
             "composer.pair_source=dataset or use composer.replay_pairs=columns"),
            (context == "success" and has_text,
             "composer.hint_fn / env is not read with sdpo_teacher_context=success (successful siblings are the "
             "only teacher context); use success+feedback to add its text as feedback, or drop it"),
            (self.context.uses_feedback and not has_text,
             f"composer.sdpo_teacher_context={context} needs each completion's feedback: set composer.env (the "
             "environment's feedback) or composer.hint_fn (its text is the feedback), or use success"),
            (self.hint_role != "user" and self.context.from_group,
             f"composer.hint_role={self.hint_role!r} acts only with sdpo_teacher_context=hint (the group contexts "
             "replace the last user turn); drop it"),
        )  # fmt: skip
        for refused, message in refusals:
            if refused:
                raise ValueError(message + ".")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None) -> ComposerVerlConfig:
        """Build from the section's flat keys; unknown keys and bad values raise ``ValueError`` naming them."""
        if mapping is not None and not isinstance(mapping, Mapping):
            raise ValueError(f"the composer section must be a mapping, got {type(mapping).__name__}.")
        given = dict(mapping or {})
        unknown = sorted(set(given) - set(section_keys()))
        if unknown:
            raise ValueError(f"composer section: unknown key(s) {unknown}; valid keys: {section_keys()}.")

        def pick(names: typing.Iterable[str]) -> dict[str, Any]:
            return {k: given.pop(k) for k in names if k in given}

        context = pick(_CONTEXT)
        if "success_reward_threshold" in context:
            given["success_reward_threshold"] = context["success_reward_threshold"]
            if (
                given.get("replay_pairs") == "on_policy"
                and context.get("sdpo_teacher_context", "hint") == "hint"
            ):
                del context["success_reward_threshold"]  # channel 3 reads it, the hint context does not
        try:
            return cls(
                compose=ComposeConfig.from_flat(**pick(CORE_OPTIONS)),
                teacher=TeacherWeightsOptions(**pick(_TEACHER)),
                context=TeacherContextOptions(**context),
                **given,
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"composer section: {err}") from None


def section_keys() -> list[str]:
    """Every key of the ``composer:`` section."""
    own = [f.name for f in fields(ComposerVerlConfig) if f.name not in _TYPED]
    return sorted({*CORE_OPTIONS, *_TEACHER, *_CONTEXT, *own})


def section_of(config: Any) -> dict[str, Any]:
    """The ``composer:`` section of verl's Hydra config, from its root (the driver) or from the
    ``actor_rollout_ref`` node verl hands each worker (its parent is the root)."""
    from omegaconf import OmegaConf

    section = OmegaConf.select(config, "..composer" if "actor" in config else "composer")
    return OmegaConf.to_container(section, resolve=True) if section is not None else {}


_current: ComposerVerlConfig | None = None


def configure(config: ComposerVerlConfig | Mapping[str, Any] | None) -> ComposerVerlConfig | None:
    """Set (a section mapping or a config) or with ``None`` clear this process's config; returns it."""
    global _current
    _current = ComposerVerlConfig.from_mapping(config) if isinstance(config, Mapping) else config
    return _current


def current_config() -> ComposerVerlConfig:
    """This process's config (:func:`configure`), else the defaults (channel 1 only)."""
    return _current if _current is not None else ComposerVerlConfig()
