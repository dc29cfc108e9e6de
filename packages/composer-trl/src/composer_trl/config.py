"""``ComposerGRPOConfig``: TRL's ``GRPOConfig`` plus the composer options (validated in ``__post_init__``).

``total = w_policy · policy + alpha_sdpo · SDPO + beta_replay · trace-replay``. Channel 1 is TRL's own GRPO loss
(``loss_type``, ``epsilon``/``epsilon_high``, ``delta``, ``beta`` KL) computed by ``composer_core`` with
TRL's op order; channel 2 distils the same model read under a hinted context into the plain context
(generalized JSD over the full vocabulary, optional TAID / entropy-aware wrapper); channel 3 is DPO or
SimPO on (chosen, rejected) completions carried in the dataset.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from composer_core.loss.config import (
    DPO,
    TAID,
    ComposeConfig,
    EntropyOPD,
    PolicyOptions,
    SDPOOptions,
    SimPO,
    flat_defaults,
    option_help,
)
from composer_core.loss.options import DPOVariant, SDPOWrapper
from composer_core.loss.policy import CLIP_LOSS_TYPES
from composer_core.loss.validation import check_choice
from composer_core.loss.wrappers import TAIDScheduler
from composer_core.sdpo import TeacherContextOptions, TeacherWeightsOptions
from composer_core.traces.onpolicy import ReplayPairOptions, ReplayPairs
from transformers import TrainingArguments
from trl import GRPOConfig

#: TAIDScheduler's own defaults (its step size alpha and momentum beta)
_TAID: dict[str, Any] = {n: p.default for n, p in inspect.signature(TAIDScheduler).parameters.items()}

_SHAPE_OPTIONS = tuple(
    f.name for f in dataclasses.fields(GRPOConfig) if f.name.startswith(("sapo_", "vespo_"))
)

#: composer_core's option classes whose fields become this config's flags: (class, flag prefix, fields left out).
#: Each flag keeps core's type, default and help text (core is the one source of truth).
_CORE_SECTIONS: tuple[tuple[type, str, tuple[str, ...]], ...] = (
    (SDPOOptions, "sdpo_", ("form", "wrapper")),  # sdpo_form: TRL's choices; sdpo_wrapper: a selector below
    (TAID, "taid_", ("t", "schedule_step", "total_steps")),  # set per step by the trainer
    (EntropyOPD, "entropy_opd_", ()),
    (DPO, "dpo_", ("rpo_alpha",)),  # rpo_alpha: one flat name for DPO and SimPO, declared below
    (SimPO, "simpo_", ("rpo_alpha",)),
    (TeacherContextOptions, "", ()),
    (TeacherWeightsOptions, "", ()),
    (ReplayPairOptions, "", ("replay_pairs",)),  # declared below
)
#: the generated flags that are the adapter's own (not ``compose_loss`` options)
_ADAPTER_SECTIONS = (TeacherContextOptions, TeacherWeightsOptions, ReplayPairOptions)
#: the generated flags that are ``compose_loss`` options (the others are the teacher's context and weights)
_COMPOSE_FIELDS: list[str] = []

_C = TypeVar("_C")


def _helped(default: Any, text: str) -> Any:
    return field(default=default, metadata={"help": text})


def _core(name: str) -> Any:
    """A flag declared here (for its static type or TRL's choices) with core's default and help text."""
    if name == "replay_pairs":
        f = next(f for f in dataclasses.fields(ReplayPairOptions) if f.name == name)
        return _helped(f.default, f.metadata["help"])
    return _helped(flat_defaults()[name], option_help(name))


def _with_core_fields(cls: type[_C]) -> type[_C]:
    """Add one dataclass field per option of ``_CORE_SECTIONS`` (core's type, default and help text) and list
    every composer option (core's and this adapter's) in the class docstring."""
    for klass, prefix, skip in _CORE_SECTIONS:
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            if f.name not in skip:
                name = prefix + f.name
                cls.__annotations__[name] = hints[f.name]
                setattr(cls, name, _helped(f.default, f.metadata["help"]))
                if klass not in _ADAPTER_SECTIONS:
                    _COMPOSE_FIELDS.append(name)
    own = [n for n in inspect.get_annotations(cls) if isinstance(cls.__dict__.get(n), dataclasses.Field)]
    cls.__doc__ = (cls.__doc__ or "") + "".join(
        f"\n    {name}: {getattr(cls, name).metadata['help']}" for name in own
    )
    return cls


@dataclass
@_with_core_fields
class ComposerGRPOConfig(GRPOConfig):
    r"""Configuration of :class:`~composer_trl.ComposerGRPOTrainer` (all ``GRPOConfig`` fields, plus these).

    With ``alpha_sdpo = beta_replay = 0`` (the defaults: a plain swap is plain GRPO until a channel is switched on)
    the trainer is GRPOTrainer bit for bit, for every ``GRPOConfig`` option (loss types, sequence-level
    importance sampling, entropy masking and bonus, the off-policy mask, vLLM's rollout log-probs and
    importance-sampling correction). Channel 2's teacher is the same model, without gradient, given a hint or a
    successful sibling (its teacher context and weights: ``composer_core.sdpo``); channel 3 is a preference
    loss on dataset pairs ``chosen``/``rejected``. The composer options (the shared ones take composer_core's
    types and defaults):
    """

    # TRL computes the inputs of one form itself, so its default is a concrete form ('auto' resolves per batch)
    sdpo_form: Literal["full", "sampled", "topk"] = _helped("full", option_help("sdpo_form"))
    w_policy: float = _core("w_policy")
    alpha_sdpo: float = _core("alpha_sdpo")
    beta_replay: float = _core("beta_replay")
    rpo_alpha: float = _core("rpo_alpha")
    replay_pairs: ReplayPairs = _core("replay_pairs")
    sdpo_wrapper: SDPOWrapper = _core("sdpo_wrapper")
    dpo_variant: DPOVariant = _core("dpo_variant")
    taid_alpha: float = _helped(_TAID["alpha"], "TAID adaptive step size (t steps once per optimiser step).")
    taid_momentum: float = _helped(_TAID["beta"], "TAID momentum (the paper's beta).")
    hint_template: str = _helped(
        "{hint}{prompt}",
        "how a hint becomes the teacher's context of a text prompt: a format string with {hint} "
        "and {prompt} (for chat prompts the hint is added to the last user message).",
    )
    replay_reference: Literal["auto", "model", "column"] = _helped(
        "auto",
        "'auto' (ref_chosen_logps/ref_rejected_logps columns when present, else the reference model), "
        "'model' or 'column'.",
    )
    replay_append_eos: bool = _helped(True, "append EOS to text chosen/rejected (as completions end).")
    max_replay_length: int | None = _helped(None, "truncate chosen/rejected (None: max_completion_length).")
    log_channel_grad_norms: bool = _helped(
        False,
        "log composer/grad_norm/{policy,sdpo,replay} at logging steps (a diagnostic: one extra backward per "
        "channel on those steps).",
    )
    # + one field per option of _CORE_SECTIONS (w_policy, alpha_sdpo, sdpo_beta, dpo_beta, sdpo_teacher, ...)

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[no-untyped-call]
        self._check_composer()

    @classmethod
    def from_grpo_config(cls, args: TrainingArguments, **options: Any) -> ComposerGRPOConfig:
        """A plain ``GRPOConfig``'s (or ``SDPOConfig``'s) options as they stand (TRL's ``__post_init__`` already ran on them), with every
        composer option at its default (channels off, plain GRPO) unless set in ``options``; checked."""
        new = cls.__new__(cls)
        new.__dict__.update(vars(args))
        for f in dataclasses.fields(cls):
            if f.name not in new.__dict__:
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]
                setattr(new, f.name, default)
        new.__dict__.update(options)
        new._check_composer()
        return new

    def _check_composer(self) -> None:
        """The checks of the composer options this adapter adds; every option shared with composer_core is checked
        once, by core's typed config built from these fields (TRL's own options ran in ``GRPOConfig.__post_init__``)."""
        check_choice("sdpo_form", self.sdpo_form, ("full", "sampled", "topk"))
        check_choice("replay_reference", self.replay_reference, ("auto", "model", "column"))
        if self.sdpo_wrapper == "taid" and (self.max_steps is None or self.max_steps <= 0):
            raise ValueError("sdpo_wrapper='taid' needs `max_steps` > 0 (the schedule's total_steps).")
        # composer_core's typed config, built (and cached) from these fields: a value out of range, an option of a
        # mode that is not selected, or one the resolved form ignores, raises here, at construction
        self.compose_config  # noqa: B018
        if self.sdpo_wrapper != "taid" and (self.taid_alpha, self.taid_momentum) != (
            _TAID["alpha"],
            _TAID["beta"],
        ):
            raise ValueError(
                f"`taid_alpha`={self.taid_alpha!r} / `taid_momentum`={self.taid_momentum!r} act only with "
                "sdpo_wrapper='taid'; select it or drop them."
            )
        if "{hint}" not in self.hint_template or "{prompt}" not in self.hint_template:
            raise ValueError(
                f"`hint_template`={self.hint_template!r} must contain both '{{hint}}' and '{{prompt}}'."
            )
        self._check_replay_pairs()
        if self.max_replay_length is not None and self.max_replay_length < 1:
            raise ValueError(f"`max_replay_length`={self.max_replay_length!r} must be >= 1 or None.")
        # core checks the teacher's options when they are built
        ctx, weights = self.teacher_context_options, self.teacher_weights_options
        if self.alpha_sdpo == 0 and (weights.sdpo_teacher != "live" or ctx.sdpo_teacher_context != "hint"):
            raise ValueError(
                f"sdpo_teacher={weights.sdpo_teacher!r} / sdpo_teacher_context={ctx.sdpo_teacher_context!r} act "
                "only with channel 2 on: set alpha_sdpo > 0 or drop them."
            )

    def _check_replay_pairs(self) -> None:
        ReplayPairOptions(self.replay_pairs)
        if self.replay_pairs == "columns":
            return
        if self.beta_replay == 0:
            raise ValueError(
                f"`replay_pairs`={self.replay_pairs!r} acts only with channel 3 on: set beta_replay > 0 or drop it."
            )
        if self.replay_reference == "column":
            raise ValueError(
                "replay_reference='column' reads a rejected side's reference log-prob, but replay_pairs='on_policy' "
                "rejects the student's own completions: use replay_reference='model' or 'auto'."
            )

    @property
    def teacher_context_options(self) -> TeacherContextOptions:
        """composer_core's :class:`~composer_core.sdpo.TeacherContextOptions` of these fields (checked when built).
        With ``replay_pairs='on_policy'`` channel 3 reads ``success_reward_threshold`` too, so the ``'hint'``
        context does not refuse it."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(TeacherContextOptions)}
        if self.replay_pairs == "on_policy" and kw["sdpo_teacher_context"] == "hint":
            kw.pop("success_reward_threshold")
        return TeacherContextOptions(**kw)

    @property
    def teacher_weights_options(self) -> TeacherWeightsOptions:
        """composer_core's :class:`~composer_core.sdpo.TeacherWeightsOptions` of these fields."""
        return TeacherWeightsOptions(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(TeacherWeightsOptions)}
        )

    @property
    def compose_config(self) -> ComposeConfig:
        """composer_core's :class:`~composer_core.loss.config.ComposeConfig` of these options (TAID's per-step t is
        set by the loss). ``ComposeConfig.from_flat`` caches it per distinct option values, so reading it on every
        step costs a dictionary lookup; it follows later edits of the fields."""
        return ComposeConfig.from_flat(**self.compose_options())

    def compose_options(self) -> dict[str, Any]:
        """The flat ``compose_loss`` options these fields mean (TRL names mapped to composer's)."""
        opts: dict[str, Any] = {
            "loss_type": self.loss_type,
            "epsilon_low": self.epsilon,
            "epsilon_high": self.epsilon_high if self.epsilon_high is not None else self.epsilon,
            "delta": self.delta,
            "kl_beta": self.beta,
            # TRL's default use_bias_correction_kl=True: the per-token KL times the ratio (acts with beta != 0)
            "kl_bias_correction": bool(self.use_bias_correction_kl) and self.beta != 0.0,
            "max_completion_length": self.max_completion_length if self.loss_type == "dr_grpo" else None,
            "importance_sampling_level": self.importance_sampling_level,
            "sdpo_form": self.sdpo_form,
            "sdpo_wrapper": self.sdpo_wrapper,
            "dpo_variant": self.dpo_variant,
            **{name: getattr(self, name) for name in ("w_policy", "alpha_sdpo", "beta_replay", "rpo_alpha")},
        }
        # SAPO's and VESPO's shape parameters (TRL's names; core refuses them set under another loss type)
        opts.update({name: getattr(self, name) for name in (*_SHAPE_OPTIONS, *_COMPOSE_FIELDS)})
        # TRL reads delta in the clip surrogate only: off (core's default) for the other loss types
        if self.loss_type not in CLIP_LOSS_TYPES:
            opts["delta"] = PolicyOptions.delta
        return opts
