"""``ComposerGRPOConfig``: TRL's ``GRPOConfig`` plus the composer options (validated in ``__post_init__``).

``total = policy + alpha_sdpo · SDPO + beta_replay · trace-replay``. Channel 1 is TRL's own GRPO loss
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

from composer_core.loss.config import DPO, TAID, ComposeConfig, EntropyOPD, SDPOOptions, SimPO
from composer_core.loss.policy import CLIP_LOSS_TYPES
from composer_core.loss.wrappers import TAIDScheduler
from composer_core.sdpo import TeacherContextOptions, TeacherWeightsOptions
from trl import GRPOConfig

#: TAIDScheduler's own defaults (its step size alpha and momentum beta)
_TAID: dict[str, Any] = {n: p.default for n, p in inspect.signature(TAIDScheduler).parameters.items()}

_SHAPE_OPTIONS = tuple(
    f.name for f in dataclasses.fields(GRPOConfig) if f.name.startswith(("sapo_", "vespo_"))
)

#: composer_core's option classes whose fields become this config's flags: (class, flag prefix, fields left out).
#: Each flag keeps core's type and default (core is the one source of truth); the help text is in ``_HELP``.
_CORE_SECTIONS: tuple[tuple[type, str, tuple[str, ...]], ...] = (
    (SDPOOptions, "sdpo_", ("form", "wrapper")),  # sdpo_form: TRL's choices; sdpo_wrapper: a selector below
    (TAID, "taid_", ("t", "schedule_step", "total_steps")),  # set per step by the trainer
    (EntropyOPD, "entropy_opd_", ()),
    (DPO, "dpo_", ()),
    (SimPO, "simpo_", ()),
    (TeacherContextOptions, "", ()),
    (TeacherWeightsOptions, "", ()),
)
_HELP = {
    "sdpo_beta": "Generalized JSD beta (0 FKL, 1 RKL).",
    "sdpo_temperature": "Divergence temperature.",
    "sdpo_token_clip": "IS clip of the sampled form.",
    "sdpo_topk": "Top-k support size of sdpo_form='topk' (student's top k).",
    "sdpo_topk_tail": "sdpo_form='topk': add the tail bucket 1 - sum_k p.",
    "sdpo_chunk_size": "Rows per chunk of the fused kernel (None: composer_core.loss.distill.chunk_rows, "
    "256 from V = 32,768).",
    "sdpo_compiled": "Run the JSD chunk kernel under torch.compile (full form, no wrapper).",
    "sdpo_loss_agg": "'token_mean' or 'seq_mean' (TRL SDPOTrainer's).",
    "taid_t_start": "TAID initial t.",
    "taid_t_end": "TAID final t.",
    "entropy_opd_threshold": "Teacher-entropy gate (nats).",
    "entropy_opd_weight": "Weight of the gated forward KL.",
    "dpo_beta": "DPO beta.",
    "dpo_loss_type": "DPO loss.",
    "dpo_label_smoothing": "cDPO / robust epsilon.",
    "simpo_beta": "SimPO beta.",
    "simpo_gamma": "SimPO absolute margin gamma.",
    "sdpo_teacher_context": "Teacher context: 'hint', 'success' (successful siblings), 'feedback', "
    "'success+feedback'.",
    "success_reward_threshold": "Reward at which a completion is a success.",
    "dont_reprompt_on_self_success": "A success is not its own demonstration.",
    "feedback_only_without_solution": "success+feedback: feedback only where no sibling succeeded.",
    "demo_pick": "Which successful sibling: 'first' or 'random' (seeded).",
    "reprompt_template": "Teacher reprompt: {prompt} {solution} {feedback}.",
    "solution_template": "Demonstration part: {demonstration}.",
    "feedback_template": "Feedback part: {feedback}.",
    "max_reprompt_len": "Keep the last this many reprompt tokens.",
    "remove_thinking_from_demonstration": "Drop <think> blocks from demos.",
    "sdpo_teacher": "Teacher weights: 'live', 'ema' or 'base'.",
    "teacher_update_rate": "EMA teacher rate tau (sdpo_teacher='ema').",
    "teacher_sync_steps": "EMA teacher update period in optimiser steps.",
}
#: the generated flags that are ``compose_loss`` options (the others are the teacher's context and weights)
_COMPOSE_FIELDS: list[str] = []

_C = TypeVar("_C")


def _with_core_fields(cls: type[_C]) -> type[_C]:
    """Add one dataclass field per option of ``_CORE_SECTIONS`` (core's type and default, ``_HELP``'s text)."""
    for klass, prefix, skip in _CORE_SECTIONS:
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            if f.name in skip:
                continue
            name = prefix + f.name
            cls.__annotations__[name] = hints[f.name]
            setattr(cls, name, field(default=f.default, metadata={"help": _HELP[name]}))
            if klass not in (TeacherContextOptions, TeacherWeightsOptions):
                _COMPOSE_FIELDS.append(name)
    return cls


@dataclass
@_with_core_fields
class ComposerGRPOConfig(GRPOConfig):
    r"""Configuration of :class:`~composer_trl.ComposerGRPOTrainer` (all ``GRPOConfig`` fields, plus these).

    Channel weights:
        alpha_sdpo: weight of channel 2 (SDPO self-distillation); 0, the default, disables it.
        beta_replay: weight of channel 3 (trace-replay preference); 0, the default, disables it.
        With both 0 the trainer is GRPOTrainer bit for bit, for every ``GRPOConfig`` option (loss types,
        sequence-level importance sampling, entropy masking and bonus, the off-policy mask, vLLM's rollout
        log-probs and importance-sampling correction).

    Channel 2 (hinted self-teacher; the teacher is the same model, no grad, given the hint):
        sdpo_form: ``"full"`` — generalized JSD over the whole vocabulary, computed chunk-wise from the
            last hidden states and the LM-head weight (never materialises [B,T,V]); ``"sampled"`` — the
            reverse-KL estimator on the sampled token only (teacher log-prob of each sampled token); ``"topk"`` —
            the divergence on the student's top-``sdpo_topk`` tokens (TRL SDPOTrainer's ``topk_logits``; this form
            materialises [B, T, V] logits of the distilled rows from the same hidden states), with the tail bucket
            ``1 − Σ_k p`` when ``sdpo_topk_tail`` (TRL's ``distillation_add_tail``).
        sdpo_beta: generalized-JSD β (TRL GKD convention: 0 forward KL, 1 reverse KL, exact branches).
        sdpo_temperature: temperature of both distributions in the divergence.
        sdpo_token_clip: importance-sampling clip of the sampled form (None = no clip).
        sdpo_chunk_size: rows per chunk of the fused kernel; None (the default) is
            ``composer_core.loss.distill.chunk_rows``: fused, 256 rows from V = 32,768 up
            (``FUSED_CHUNK_LOGITS // V`` below); on logits ``CHUNK_LOGITS // V``. A chunk holds about four
            [rows, V] float32 buffers; more rows trade memory for speed.
        sdpo_compiled: run the JSD chunk kernel under ``torch.compile`` (``sdpo_form="full"``, no wrapper;
            one compilation on the first step). On a GPU it removes most of the kernel's time above the LM-head
            matmuls (the README's CUDA table); Liger-Kernel's ``use_liger_kernel`` losses compile the same way.
        sdpo_wrapper: ``"none"``, ``"taid"`` (interpolated target, adaptive t, arXiv 2501.16937) or
            ``"entropy_opd"`` (extra forward KL where the teacher is uncertain).
        taid_t_start / taid_t_end / taid_alpha / taid_momentum: TAID schedule (stepped once per optimiser
            step from the globally reduced SDPO loss; ``max_steps`` must be set).
        entropy_opd_threshold / entropy_opd_weight: the entropy gate and the weight of its forward KL.
        hint_template: how a ``hint`` becomes the teacher's context, a format string with ``{hint}`` and
            ``{prompt}`` for text prompts (for chat prompts the hint is added to the last user message).
        sdpo_loss_agg: ``"token_mean"`` (Σ over distilled tokens / their global count, TRL's ``dapo``
            convention) or ``"seq_mean"`` (TRL ``SDPOTrainer``: each row's mean over its distilled tokens, summed
            and divided by the number of rows, distilled or not).

    Channel 2's teacher context and weights (SDPO as its authors run it; ``composer_core.sdpo``):
        sdpo_teacher_context: ``"hint"`` (a ``hint``/``hinted_prompt`` column or ``hint_fn``; the default),
            ``"success"`` (a successful sibling of the same group is the demonstration: no hint, no oracle),
            ``"feedback"`` (``hint_fn``'s text or a ``privileged_context`` column as the environment's feedback)
            or ``"success+feedback"``. Rows without a teacher context are not distilled.
        success_reward_threshold: the reward at which a completion counts as a success.
        dont_reprompt_on_self_success: a completion that succeeded is not its own demonstration.
        feedback_only_without_solution: ``"success+feedback"``: feedback only where no sibling succeeded.
        demo_pick: ``"first"`` successful sibling (TRL, lasgroup/SDPO) or ``"random"`` (seeded by ``seed``).
        reprompt_template (``{prompt}``, ``{solution}``, ``{feedback}``), solution_template
            (``{demonstration}``), feedback_template (``{feedback}``): the teacher's reprompt.
        max_reprompt_len: keep the last this many tokens of a reprompt.
        remove_thinking_from_demonstration: drop ``<think>…</think>`` from the demonstration.
        sdpo_teacher: ``"live"`` (the student, no extra memory), ``"ema"`` (an EMA of the student, one extra
            copy) or ``"base"`` (the frozen initial model; with PEFT the base with adapters off).
        teacher_update_rate / teacher_sync_steps: the EMA's τ and period in optimiser steps (``"ema"`` only).

    Channel 3 (preference on dataset pairs ``chosen``/``rejected``):
        dpo_variant: ``"dpo"`` (reference log-probs needed) or ``"simpo"`` (reference-free, length-normalised).
        dpo_beta / dpo_loss_type / dpo_label_smoothing: DPO β, ``"sigmoid"|"robust"|"ipo"``, cDPO ε.
        simpo_beta / simpo_gamma: SimPO β and absolute margin γ.
        replay_reference: ``"auto"`` (dataset columns ``ref_chosen_logps``/``ref_rejected_logps`` when
            present, else the reference model), ``"model"`` or ``"column"``.
        replay_append_eos: append EOS to text ``chosen``/``rejected`` (as the policy's own completions end).
        max_replay_length: truncate chosen/rejected to this many tokens (None = ``max_completion_length``).
    """

    # Off by default: swapping GRPOTrainer for ComposerGRPOTrainer is plain GRPO until a channel is switched on
    # (composer-train chooses them from what the dataset or environment provides and says so).
    alpha_sdpo: float = field(
        default=0.0,
        metadata={"help": "Weight of channel 2 (SDPO self-distillation); 0 (default) disables it."},
    )
    beta_replay: float = field(
        default=0.0,
        metadata={"help": "Weight of channel 3 (trace-replay preference); 0 (default) disables it."},
    )

    sdpo_form: Literal["full", "sampled", "topk"] = field(
        default="full", metadata={"help": "'full', 'sampled' or 'topk' (with sdpo_topk)."}
    )
    sdpo_wrapper: Literal["none", "taid", "entropy_opd"] = field(
        default="none", metadata={"help": "'none', 'taid' or 'entropy_opd'."}
    )
    taid_alpha: float = field(default=_TAID["alpha"], metadata={"help": "TAID adaptive step size."})
    taid_momentum: float = field(default=_TAID["beta"], metadata={"help": "TAID momentum (paper's beta)."})
    hint_template: str = field(default="{hint}{prompt}", metadata={"help": "Hinted context of text prompts."})
    dpo_variant: Literal["dpo", "simpo"] = field(default="dpo", metadata={"help": "'dpo' or 'simpo'."})
    replay_reference: Literal["auto", "model", "column"] = field(
        default="auto", metadata={"help": "Where DPO reference log-probs come from."}
    )
    replay_append_eos: bool = field(default=True, metadata={"help": "Append EOS to text chosen/rejected."})
    max_replay_length: int | None = field(default=None, metadata={"help": "Token cap of chosen/rejected."})
    # + one field per option of _CORE_SECTIONS (sdpo_beta, dpo_beta, sdpo_teacher, ...), added by _with_core_fields

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[no-untyped-call]
        self._check_composer()

    @classmethod
    def from_grpo_config(cls, args: GRPOConfig) -> ComposerGRPOConfig:
        """A plain ``GRPOConfig``'s options as they stand (TRL's ``__post_init__`` already ran on them), with every
        composer option at its default: channels off, plain GRPO."""
        new = cls.__new__(cls)
        new.__dict__.update(vars(args))
        for f in dataclasses.fields(cls):
            if f.name not in new.__dict__:
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]
                setattr(new, f.name, default)
        new._check_composer()
        return new

    def _check_composer(self) -> None:
        """The checks of the composer options this adapter adds; every option shared with composer_core is checked
        once, by core's typed config built from these fields (TRL's own options ran in ``GRPOConfig.__post_init__``)."""
        _choice("sdpo_form", self.sdpo_form, ("full", "sampled", "topk"))
        _choice("replay_reference", self.replay_reference, ("auto", "model", "column"))
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
        if self.max_replay_length is not None and self.max_replay_length < 1:
            raise ValueError(f"`max_replay_length`={self.max_replay_length!r} must be >= 1 or None.")
        ctx, weights = (
            self.teacher_context_options,
            self.teacher_weights_options,
        )  # core checks them when built
        if self.alpha_sdpo == 0 and (weights.sdpo_teacher != "live" or ctx.sdpo_teacher_context != "hint"):
            raise ValueError(
                f"sdpo_teacher={weights.sdpo_teacher!r} / sdpo_teacher_context={ctx.sdpo_teacher_context!r} act "
                "only with channel 2 on: set alpha_sdpo > 0 or drop them."
            )

    @property
    def teacher_context_options(self) -> TeacherContextOptions:
        """composer_core's :class:`~composer_core.sdpo.TeacherContextOptions` of these fields (checked when built)."""
        return TeacherContextOptions(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(TeacherContextOptions)}
        )

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
            "alpha_sdpo": self.alpha_sdpo,
            "beta_replay": self.beta_replay,
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
        }
        # SAPO's and VESPO's shape parameters (TRL's names; core refuses them set under another loss type)
        opts.update({name: getattr(self, name) for name in (*_SHAPE_OPTIONS, *_COMPOSE_FIELDS)})
        if self.loss_type not in CLIP_LOSS_TYPES:
            opts["delta"] = None  # TRL reads delta in the clip surrogate only
        return opts


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"`{name}`={value!r} is not one of {allowed}.")
