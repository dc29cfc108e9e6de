"""``ComposerSDPOTrainer``: a drop-in for TRL 1.16's ``trl.experimental.sdpo.SDPOTrainer``.

Swap ``SDPOTrainer``/``SDPOConfig`` for ``ComposerSDPOTrainer``/``ComposerSDPOConfig`` (or hand TRL's own
``SDPOConfig`` to ``ComposerSDPOTrainer``): same constructor signature, every ``SDPOConfig`` field read with
SDPOTrainer's meaning and default, translated once by :data:`SDPO_TO_COMPOSER` into the options of
:class:`~composer_trl.ComposerGRPOTrainer` (whose channel 2 is SDPO), plus composer's channel 3 and wrappers
(``ComposerSDPOConfig``'s extra fields). What SDPOTrainer adds around its loss is kept: its callback events
(``on_teacher_context_built``, ``on_self_distillation_batch_prepared``, ``on_generation_prompts_selected``,
``on_generation_batch_built``, same arguments), its degenerate-run warnings (``diagnostics_warning_interval``,
``diagnostics_flat_tolerance``), its prompt cut (``max_prompt_length``) and its teacher-server path
(``use_teacher_server``: TRL's own code, the teacher's log-probs from the vLLM server).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from composer_core.sdpo import TeacherContexts
from trl import GRPOConfig
from trl.experimental.sdpo import SDPOConfig, SDPOTrainer
from trl.trainer.utils import get_config_model_id, pad

from composer_trl.config import ComposerGRPOConfig
from composer_trl.teacher import base_model
from composer_trl.trainer import ComposerGRPOTrainer

_FORMS = {"sampled_token": "sampled", "full_logits": "full", "topk_logits": "topk"}


def _context(a: SDPOConfig) -> str:
    success, feedback = a.use_successful_as_teacher, a.include_environment_feedback
    if not (success or feedback):
        raise ValueError(
            "use_successful_as_teacher=False with include_environment_feedback=False leaves SDPO no teacher "
            "context (the distillation loss is 0 on every row); enable one of them."
        )
    return "success+feedback" if success and feedback else ("success" if success else "feedback")


#: composer option <- the SDPOConfig field(s) it is read from: the one place SDPOConfig is translated (the README's
#: table lists every field). SDPOTrainer's loss is ``(1 − w)·policy + w·distill``, composer's
#: ``w_policy·policy + alpha_sdpo·sdpo``; SDPOTrainer averages each row's distillation loss (``seq_mean``).
SDPO_TO_COMPOSER: dict[str, Callable[[SDPOConfig], Any]] = {
    "w_policy": lambda a: 1.0 - a.distillation_weight,
    "alpha_sdpo": lambda a: a.distillation_weight,
    "sdpo_form": lambda a: _FORMS[a.distillation_mode],
    "sdpo_beta": lambda a: a.distillation_alpha,
    "sdpo_topk": lambda a: a.distillation_topk,
    "sdpo_topk_tail": lambda a: a.distillation_add_tail if a.distillation_mode == "topk_logits" else True,
    "sdpo_token_clip": lambda a: a.distillation_is_clip,
    "sdpo_temperature": lambda a: 1.0 if a.distillation_mode == "sampled_token" else a.temperature,
    "sdpo_loss_agg": lambda a: "seq_mean",
    "sdpo_teacher": lambda a: a.teacher_model_kind,
    "teacher_update_rate": lambda a: a.teacher_update_rate,
    "teacher_sync_steps": lambda a: a.teacher_sync_steps,
    "sdpo_teacher_context": _context,
    "feedback_only_without_solution": lambda a: (
        a.environment_feedback_only_without_solution and a.use_successful_as_teacher
    ),
    "success_reward_threshold": lambda a: a.success_reward_threshold,
    "dont_reprompt_on_self_success": lambda a: a.dont_reprompt_on_self_success,
    "max_reprompt_len": lambda a: a.max_reprompt_len,
    "remove_thinking_from_demonstration": lambda a: a.remove_thinking_from_demonstration,
    "reprompt_template": lambda a: a.reprompt_template,
    "solution_template": lambda a: a.solution_template.replace(
        "{successful_previous_attempt}", "{demonstration}"
    ),
    "feedback_template": lambda a: a.feedback_template.replace("{feedback_raw}", "{feedback}"),
    "vllm_importance_sampling_correction": lambda a: False,  # SDPOTrainer corrects no vLLM rollout mismatch
}
_GRPO_FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig)}
_SDPO_FIELDS = {f.name for f in dataclasses.fields(SDPOConfig)}
#: composer's own options with no SDPOConfig counterpart (channel 3, wrappers, kernels, demo_pick): extra fields
_EXTRAS = [
    f
    for f in dataclasses.fields(ComposerGRPOConfig)
    if f.name not in _GRPO_FIELDS
    and f.name not in _SDPO_FIELDS
    and f.name not in SDPO_TO_COMPOSER
    and f.name != "hint_template"  # the teacher context is never a hint here
]


def _with_extras(cls: type[Any]) -> type[Any]:
    """Add :data:`_EXTRAS` as fields (composer's type, default and ``--help``)."""
    for f in _EXTRAS:
        cls.__annotations__[f.name] = f.type
        setattr(cls, f.name, field(default=f.default, metadata=dict(f.metadata)))
    return cls


@dataclass
@_with_extras
class ComposerSDPOConfig(SDPOConfig):
    """TRL's ``SDPOConfig`` (every field, SDPOTrainer's defaults) plus composer's options it has no counterpart of:
    channel 3 (``beta_replay``, ``dpo_*``, ``simpo_*``, ``replay_*``), the channel-2 wrappers (``sdpo_wrapper``,
    ``taid_*``, ``entropy_opd_*``), the kernel options (``sdpo_chunk_size``, ``sdpo_compiled``) and
    ``demo_pick``, at composer's defaults (see :class:`~composer_trl.ComposerGRPOConfig`)."""

    # + every option of _EXTRAS, added by _with_extras

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[no-untyped-call]
        grpo_config(self)  # every check of the translated options runs at construction


def grpo_config(args: SDPOConfig) -> ComposerGRPOConfig:
    """The :class:`ComposerGRPOConfig` an ``SDPOConfig`` means: its shared fields as they stand (TRL's
    ``__post_init__`` already ran on them), GRPOConfig's own at their defaults, the SDPO fields translated by
    :data:`SDPO_TO_COMPOSER`; the SDPO fields themselves stay readable on it (``args.distillation_weight``)."""
    mapped = {name: to(args) for name, to in SDPO_TO_COMPOSER.items()}
    # plain policy gradient: no channel 2, its options at composer's defaults
    if args.distillation_weight == 0:
        keep = ("w_policy", "alpha_sdpo", "vllm_importance_sampling_correction")
        mapped = {k: v if k in keep else getattr(ComposerGRPOConfig, k, v) for k, v in mapped.items()}
    pad_to = vars(args).get("pad_to_multiple_of", "auto")  # GRPOConfig's default, resolved as None here
    pad_to = None if pad_to == "auto" else pad_to
    return ComposerGRPOConfig.from_grpo_config(args, pad_to_multiple_of=pad_to, **mapped)


class ComposerSDPOTrainer(ComposerGRPOTrainer):
    """``SDPOTrainer``'s constructor and behaviour on composer's objective (see the module docstring)."""

    _name = "SDPO"
    _tag_names = ["trl", "sdpo", "composer"]  # noqa: RUF012  (TRL declares it a plain list)
    # SDPOTrainer's own helpers, unchanged: its callback dispatch and its teacher-server loss
    _dispatch_self_distillation_callback: Any = SDPOTrainer._dispatch_self_distillation_callback
    _warn_on_degenerate_diagnostics: Any = SDPOTrainer._warn_on_degenerate_diagnostics
    _compute_server_distillation_loss: Any = SDPOTrainer._compute_server_distillation_loss
    _get_teacher_token_logprobs_from_server: Any = SDPOTrainer._get_teacher_token_logprobs_from_server
    _forward_logits: Any = SDPOTrainer._forward_logits
    _log_self_distillation_metric: Any = SDPOTrainer._log_self_distillation_metric

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: SDPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
    ) -> None:
        if reward_funcs is None or (isinstance(reward_funcs, list) and not reward_funcs):
            raise ValueError("`reward_funcs` is required: SDPO scores rollouts to find the successful ones.")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required.")
        if args is None:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = ComposerSDPOConfig(f"{name.split('/')[-1]}-SDPO")
        if not isinstance(args, SDPOConfig):
            raise ValueError(
                f"ComposerSDPOTrainer's `args` must be an SDPOConfig, got {type(args).__name__}."
            )
        _check_teacher_server(args)
        self.sdpo_args = args
        self.use_teacher_server = args.use_teacher_server
        self._diagnostic_counters: dict[str, dict[str, int]] = {
            m: defaultdict(int) for m in ("train", "eval")
        }
        self._last_contexts: TeacherContexts | None = None
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=grpo_config(args),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )
        self.temperature = args.temperature
        self._last_loaded_step = getattr(self, "_last_loaded_step", 0)  # GRPOTrainer sets it with vLLM only
        self.model_kwarg_keys = inspect.signature(
            base_model(self.model).forward
        ).parameters.keys()  # read by _forward_logits
        self.teacher_client = None
        if self.use_teacher_server:
            from trl.generation.vllm_client import VLLMClient

            url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
            self.teacher_client = VLLMClient(base_url=url, connection_timeout=args.vllm_server_timeout)

    # ------------------------------------------------------------------ generation

    def _policy_prompt_ids(self, prompts: list[Any], ids: list[list[int]]) -> list[list[int]]:
        """SDPOTrainer cuts the policy's prompts (not the teacher's reprompts) to ``max_prompt_length``."""
        ids, limit = super()._policy_prompt_ids(prompts, ids), self.sdpo_args.max_prompt_length
        return ids if limit is None else [row[-limit:] for row in ids]

    def _log_contexts(self, mode: str, ctx: TeacherContexts) -> None:
        super()._log_contexts(mode, ctx)
        self._last_contexts = ctx

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._dispatch_self_distillation_callback(
            "on_generation_prompts_selected",
            generation_prompts=[x["prompt"] for x in inputs],
            generation_prompt_text=None,
        )
        self._last_contexts = None
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        self._diagnose(mode)
        if "composer_hint_ids" in output:
            self._teacher_events(output)
        if mode == "train":
            steps = int(self.args.steps_per_generation or 1)  # set by SDPOConfig.__post_init__
            self._dispatch_self_distillation_callback(
                "on_generation_batch_built",
                generate_every=steps * self.args.num_iterations,
                steps_per_generation=steps,
            )
        return output

    def _teacher_events(self, output: dict[str, Any]) -> None:
        """SDPOTrainer's two events with its tensors: the teacher's input (its reprompt, or the plain prompt on a
        row without one, ⊕ the completion), the completion mask and the self-distillation mask."""
        has, pad_id = output["composer_has_hint"], self._tokenizer.pad_token_id
        rows = zip(
            *(output[k] for k in ("composer_hint_ids", "composer_hint_mask", "prompt_ids", "prompt_mask"))
        )
        prompts = [
            h_ids[h_m.bool()] if h else p_ids[p_m.bool()] for h, (h_ids, h_m, p_ids, p_m) in zip(has, rows)
        ]
        ids = pad(prompts, padding_value=pad_id, padding_side="left")
        mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left")
        teacher = _teacher_batch(output, ids, mask)
        self._dispatch_self_distillation_callback(
            "on_teacher_context_built", completion_mask=output["completion_mask"], **teacher
        )
        self._dispatch_self_distillation_callback(
            "on_self_distillation_batch_prepared",
            old_per_token_logps=output.get("old_per_token_logps"),
            prompt_ids=output["prompt_ids"],
            completion_ids=output["completion_ids"],
            **teacher,
        )

    def _diagnose(self, mode: str) -> None:
        """SDPOTrainer's degenerate-run warnings (flat rewards, no reprompted row, no successful rollout), each
        logged at its first and every ``diagnostics_warning_interval``-th consecutive occurrence."""
        a, rpf = self.sdpo_args, self._last_rewards_per_func
        tol = a.diagnostics_flat_tolerance
        checks: dict[str, tuple[bool, str]] = {}
        if rpf is not None:
            rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
            group_std = rewards.view(-1, self._group_size(mode)).std(dim=1)
            flat = float(rewards.std()) <= tol if rewards.numel() > 1 else True
            flat_groups = float((group_std <= tol).float().mean()) >= 1.0 - tol if group_std.numel() else True
            checks["flat_rewards"] = (
                flat and flat_groups,
                "Observed flat SDPO rewards across all sampled generations: every advantage is 0, so the "
                "policy term learns nothing; check the reward functions or `success_reward_threshold`.",
            )
        ctx = self._last_contexts
        if self.compose_config.alpha_sdpo > 0:
            reprompted = sum(ctx.mask) / max(1, len(ctx.mask)) if ctx is not None else 0.0
            checks["inactive_self_distillation"] = (
                reprompted <= tol,
                "SDPO self-distillation is inactive because no reprompted samples were constructed: no rollout "
                "reached `success_reward_threshold` and no environment feedback was used.",
            )
            if self.teacher_context.uses_success:
                succeeded = ctx.groups_with_success / max(1, ctx.groups) if ctx is not None else 0.0
                checks["no_successful_rollouts"] = (
                    succeeded <= tol,
                    "SDPO found no successful rollout in this batch's generation groups; if it persists, lower "
                    "`success_reward_threshold`, reshape the rewards or ease the task.",
                )
        for key, (degenerate, message) in checks.items():
            if degenerate:
                self._warn_on_degenerate_diagnostics(mode=mode, counter_key=key, message=message)
            else:
                self._diagnostic_counters[mode][key] = 0

    # ------------------------------------------------------------------ the loss

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        if not self.use_teacher_server:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # TRL's teacher-server path (the teacher's top-k log-probs come from the vLLM server, not a forward)
        loss = self._compute_server_distillation_loss(model, self._sdpo_view(inputs))
        return loss / (self.current_gradient_accumulation_steps if self.model.training else 1.0)

    def _sdpo_view(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """A composer batch in SDPOTrainer's keys (``teacher_input_ids``, ...); an SDPOTrainer batch as it is."""
        if "teacher_input_ids" in inputs or "composer_hint_ids" not in inputs:
            return inputs
        return {**inputs, **_teacher_batch(inputs, inputs["composer_hint_ids"], inputs["composer_hint_mask"])}


def _teacher_batch(
    batch: dict[str, Any], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> dict[str, Any]:
    """SDPOTrainer's teacher keys: the teacher's prompt ⊕ the completion, and the self-distillation row mask."""
    return {
        "teacher_input_ids": torch.cat([prompt_ids, batch["completion_ids"]], dim=1),
        "teacher_attention_mask": torch.cat([prompt_mask, batch["completion_mask"]], dim=1),
        "self_distillation_mask": batch["composer_has_hint"].float(),
    }


def _check_teacher_server(a: SDPOConfig) -> None:
    """SDPOTrainer's conditions on ``use_teacher_server`` (the server returns the live student's top-k log-probs)."""
    if not a.use_teacher_server:
        return
    if not (a.use_vllm and a.vllm_mode == "server"):
        raise ValueError(
            "`use_teacher_server=True` needs use_vllm=True and vllm_mode='server' (the teacher is served there)."
        )
    if a.teacher_model_kind != "live" or a.distillation_weight != 1.0:
        raise ValueError(
            "`use_teacher_server=True` needs teacher_model_kind='live' and distillation_weight=1.0 (the server holds "
            f"the live student and returns top-k log-probs only), got {a.teacher_model_kind!r} and {a.distillation_weight}."
        )
    if a.distillation_mode == "full_logits":
        raise ValueError(
            "`use_teacher_server=True` needs distillation_mode 'sampled_token' or 'topk_logits' (the server "
            "returns top-k log-probs, not the full vocabulary)."
        )
