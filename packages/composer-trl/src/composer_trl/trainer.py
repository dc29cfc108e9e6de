"""``ComposerGRPOTrainer``: TRL's ``GRPOTrainer`` computing composer's 3-channel objective.

Swap ``GRPOTrainer``/``GRPOConfig`` for ``ComposerGRPOTrainer``/``ComposerGRPOConfig``; everything else
(reward functions, datasets, PEFT, accelerate launch) stays TRL's. Per micro-batch, weighted once by
:func:`composer_core.loss.compose.compose_loss` (:mod:`composer_trl.loss`)::

    loss = w_policy · policy + alpha_sdpo · sdpo + beta_replay · replay

- **policy** (channel 1): TRL 1.16's GRPO loss for every ``loss_type``, in TRL's op order, so with
  ``alpha_sdpo = beta_replay = 0`` loss and gradients equal ``GRPOTrainer``'s bit for bit; ``w_policy = 0`` is
  pure self-distillation (no surrogate, no ``kl`` / ``clip_ratio`` metrics).
- **sdpo** (channel 2, :mod:`composer_trl.teacher`): the same model, without gradient, reads a teacher context
  (a hint, or the group's successes and feedback) and teaches the plain-context student on the completion tokens
  of those rows; the full-vocabulary generalized JSD runs chunk-wise from hidden states and the LM-head weight,
  never materialising [B, T, V].
- **replay** (channel 3, :mod:`composer_trl.replay`): DPO or SimPO on ``chosen``/``rejected`` completions of the
  prompt, or on-policy pairs (each failed completion rejected).

Each channel is normalised by its own global count (tokens of hinted rows, pairs) over the accumulation
window and all processes, like TRL's ``dapo``, so gradient accumulation is exact.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Any

import torch
from composer_core.loss.compose import ComposerBatch
from composer_core.traces.onpolicy import check_on_policy_columns
from torch import Tensor
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_config_model_id

from composer_trl.config import ComposerGRPOConfig
from composer_trl.guards import (
    check_batch_prompts,
    check_scored,
    deferred_trl_none_warning,
    guarded_reward_funcs,
    reward_func_label,
    row_indices,
)
from composer_trl.loss import Counts, composer_trl_loss
from composer_trl.metrics import logs_this_step
from composer_trl.recipe import HINT_COLUMNS, PAIR_COLUMNS
from composer_trl.replay import MergedPairs, ReplayPairs
from composer_trl.teacher import ALIASES, HiddenCapture, HintFn, K, base_model

COMPOSER_COLUMNS = (
    "hint", "hinted_prompt", "chosen", "rejected", "chosen_mask", "rejected_mask", "ref_chosen_logps",
    "ref_rejected_logps", "privileged_context", *ALIASES.values(),
)  # fmt: skip
"""Dataset columns the trainer reads (kept through TRL's column removal): hints, pairs, SDPOTrainer's feedback
column ``privileged_context`` and the trace-record aliases (:data:`~composer_trl.teacher.ALIASES`)."""

_GRPO_SIGNATURE = inspect.signature(GRPOTrainer.__init__)


class ComposerGRPOTrainer(ReplayPairs):
    """``GRPOTrainer`` whose loss is composer's 3-channel objective (see the module docstring).

    Its layers, one concern each: :class:`~composer_trl.metrics.ComposerMetrics` (TRL's and composer's metrics,
    the entropy bonus, TAID), :class:`~composer_trl.teacher.SDPOTeacher` (channel 2's teacher) and
    :class:`~composer_trl.replay.ReplayPairs` (channel 3's pairs); this class wires them into TRL's generation and
    loss.

    Args:
        *args, **kwargs: exactly ``GRPOTrainer``'s, positionally or by name, in its order (``model``,
            ``reward_funcs``, ``args``, ``train_dataset``, ``eval_dataset``, ``processing_class``, ...). ``args``: a
            :class:`ComposerGRPOConfig` (a plain ``GRPOConfig`` is taken with the channels off).
        hint_fn: optional callable ``hint_fn(prompts=..., completions=..., completion_ids=..., **columns)``
            returning one hint (str) or ``None`` per completion — e.g. a verifier's feedback. It replaces the
            ``hint`` column. Rows without a hint are not distilled.

    Raises:
        ValueError: at construction, for a channel whose weight is > 0 but whose inputs the dataset cannot
            provide, or a model/option combination the adapter cannot compute.
    """

    def __init__(self, *args: Any, hint_fn: HintFn | None = None, **kwargs: Any) -> None:
        kwargs = _with_composer_config(args, kwargs)
        if hint_fn is not None and not callable(hint_fn):
            raise ValueError(f"`hint_fn` must be callable, got {type(hint_fn).__name__}.")
        config: ComposerGRPOConfig = kwargs["args"]
        if hint_fn is not None and config.teacher_context_options.sdpo_teacher_context == "success":
            raise ValueError(
                "`hint_fn` is not read with sdpo_teacher_context='success' (successful siblings are the only "
                "teacher context); use 'success+feedback' to add its text as feedback, or drop hint_fn."
            )
        super().__init__(**kwargs)
        self.hint_fn = hint_fn
        self.compose_config = self.args.compose_config  # composer_core's typed config: built once, here
        columns = dataset_columns(self.train_dataset)
        check_channel_inputs(self.args, columns, hint_fn=hint_fn is not None)
        self._setup_replay(columns)
        self._setup_sdpo()
        self._setup_metrics()

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()  # type: ignore[no-untyped-call]
        if self._signature_columns is not None:
            missing = [c for c in COMPOSER_COLUMNS if c not in self._signature_columns]
            self._signature_columns = [*self._signature_columns, *missing]

    # ------------------------------------------------------------------ generation: carry the extra columns

    def _calculate_rewards(
        self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any
    ) -> Tensor:
        """TRL's, plus one-line :class:`~composer_trl.guards.RewardFunctionError` for a reward function that
        raises (or returns the wrong number/kind of rewards) and for a batch no function scored at all."""
        step = f"step {self.state.global_step + 1}" if self.model.training else "evaluation"

        def rows() -> list[int | None]:
            return row_indices(self.train_dataset, prompts)

        labels = [reward_func_label(f, n) for f, n in zip(self.reward_funcs, self.reward_func_names)]
        with deferred_trl_none_warning(), guarded_reward_funcs(self, rows, step):
            rewards_per_func: Tensor = super()._calculate_rewards(
                inputs, prompts, completions, completion_ids_list
            )
            check_scored(rewards_per_func, labels, rows, step)  # TRL's warning is logged if it passes
        self._last_rewards_per_func = rewards_per_func  # gathered over processes: the group's successes
        return rewards_per_func

    def _generate(self, prompts: list[Any]) -> Any:
        self._policy_prompts = True  # the batch's prompts, tokenized first (then the SDPO teacher contexts)
        try:
            return super()._generate(prompts)
        finally:
            self._policy_prompts = False

    def _tokenize_prompts(self, prompts: list[Any]) -> Any:
        ids, *rest = super()._tokenize_prompts(prompts)
        if getattr(self, "_policy_prompts", False):
            self._policy_prompts = False
            ids = self._policy_prompt_ids(prompts, ids)
        return (ids, *rest)

    def _policy_prompt_ids(self, prompts: list[Any], ids: list[list[int]]) -> list[list[int]]:
        """The policy's prompt ids, checked against the model's context."""
        check_batch_prompts(self, prompts, ids)
        return ids

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        if self.compose_config.alpha_sdpo > 0 and self.teacher_context.sdpo_teacher_context == "hint":
            output.update(self._build_hints(inputs, output))
        elif self.compose_config.alpha_sdpo > 0:
            output.update(self._build_group_contexts(inputs, output, mode))
        if self.compose_config.beta_replay > 0:
            output.update(self._build_pairs(inputs, output, mode))
        return output

    # ------------------------------------------------------------------ the loss

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        a, c = self.args, self.compose_config
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        want_sdpo = c.alpha_sdpo > 0 and bool(inputs.get(f"{K}has_hint", torch.zeros(1)).any())
        want_replay = c.beta_replay > 0 and bool(inputs.get(f"{K}has_pair", torch.zeros(1)).any())
        # The chosen/rejected rows ride in the student's forward (one forward over [B + 2P] rows) unless
        # the MoE aux loss is on: TRL's router loss must see the policy rows only.
        on_policy = a.replay_pairs == "on_policy"
        merged = None
        if want_replay and not self.aux_loss_enabled:
            merged = MergedPairs(
                inputs, logits_to_keep, self._tokenizer.pad_token_id, sides=1 if on_policy else 2
            )
            input_ids, attention_mask = merged.input_ids(input_ids), merged.attention(attention_mask)
        capture = HiddenCapture(base_model(model)) if want_sdpo and a.sdpo_form != "sampled" else None
        with capture if capture is not None else nullcontext():
            per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep if merged is None else merged.width,
                compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled,
            )
        if merged is not None:
            pair_logps = per_token_logps
            per_token_logps, entropies = merged.policy(per_token_logps), merged.policy(entropies)
            if capture is not None and capture.hidden is not None:
                capture.hidden = merged.policy_hidden(capture.hidden)

        # w_policy=0 (pure self-distillation): no surrogate, so neither its masks nor its KL / clip metrics
        pure = c.w_policy == 0
        keep, entropy_mask = (
            (None, None) if pure else self._surrogate_masks(per_token_logps, entropies, mask, inputs)
        )
        vllm_is = self.use_vllm and self.vllm_importance_sampling_correction  # TRL's rollout IS correction
        batch = ComposerBatch(
            logprobs=per_token_logps,
            advantages=inputs["advantages"],
            completion_mask=mask,
            old_logprobs=inputs.get("old_per_token_logps"),
            ref_logprobs=inputs["ref_per_token_logps"] if self.beta != 0.0 else None,
            rollout_is_weights=inputs["importance_sampling_ratio"] if vllm_is else None,
            surrogate_mask=keep,
        )
        if want_sdpo:
            self._fill_sdpo(batch, model, inputs, mask, capture, logits_to_keep)
        if want_replay:
            sums = None if merged is None else merged.pair_sums(pair_logps)
            self._fill_replay(batch, model, inputs, sums, per_token_logps if on_policy else None)
        training = mode == "train"
        counts = Counts(
            num_items=inputs["num_items_in_batch"],
            sdpo_items=inputs.get(f"{K}sdpo_num_items") if want_sdpo else None,
            replay_items=inputs.get(f"{K}replay_num_items"),
            num_processes=self.accelerator.num_processes,
            accumulation=self.current_gradient_accumulation_steps if training else 1,
            steps_per_generation=int(a.steps_per_generation or 1) if training else 1,  # GRPOConfig sets it
        )
        loss, result = composer_trl_loss(
            batch, c, counts, taid_now=None if self._taid is None else self._taid.t
        )
        if training and a.log_channel_grad_norms and logs_this_step(self):
            self._log_channel_grad_norms(model, result)
        # the policy term as TRL scales it (0: w_policy=0 computed none)
        policy = torch.zeros((), device=loss.device) if result.policy is None else result.policy.detach()
        bonus = self._entropy_bonus(
            entropies, mask if entropy_mask is None else mask * entropy_mask, mode, policy
        )
        if bonus is not None:
            loss = loss - bonus
        if aux_loss is not None:
            # GRPOTrainer's MoE router load-balancing loss, scaled for accumulation like its policy loss
            loss = loss + self.router_aux_loss_coef * aux_loss / counts.accumulation
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux_loss).mean().item()
            )
        self._log_trl_metrics(mode, per_token_logps, entropies, mask, inputs, policy=not pure)
        self._log_composer_metrics(mode, policy, result, loss.detach())
        return loss


# introspection shows GRPOTrainer's parameters (positional order included) plus the keyword-only ``hint_fn``
ComposerGRPOTrainer.__init__.__signature__ = _GRPO_SIGNATURE.replace(  # type: ignore[attr-defined]
    parameters=[
        *_GRPO_SIGNATURE.parameters.values(),
        inspect.Parameter("hint_fn", inspect.Parameter.KEYWORD_ONLY, default=None),
    ]
)


def _with_composer_config(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """GRPOTrainer's arguments, every positional one bound by name as ``GRPOTrainer.__init__`` binds it (so
    positional and keyword construction are the same call), with ``args`` made a :class:`ComposerGRPOConfig`:
    ``None`` → TRL's default config (``"<model>-GRPO"``), a plain ``GRPOConfig`` → its options with the channels
    off (a plain swap)."""
    kwargs = _GRPO_SIGNATURE.bind(None, *args, **kwargs).arguments  # TypeError as GRPOTrainer raises it
    del kwargs["self"]
    targs = kwargs.get("args")
    if targs is None:
        model = kwargs.get("model")
        name = model if isinstance(model, str) else get_config_model_id(model.config)  # type: ignore[union-attr]
        targs = ComposerGRPOConfig(f"{name.split('/')[-1]}-GRPO")
    elif not isinstance(targs, ComposerGRPOConfig):
        if not isinstance(targs, GRPOConfig):
            raise ValueError(
                f"ComposerGRPOTrainer's `args` must be a GRPOConfig or ComposerGRPOConfig, got {type(targs).__name__}."
            )
        targs = ComposerGRPOConfig.from_grpo_config(targs)
    kwargs["args"] = targs
    return kwargs


def dataset_columns(dataset: Any) -> set[str] | None:
    """A dataset's columns under their composer names (None: unknown, e.g. an iterable dataset)."""
    names = getattr(dataset, "column_names", None)
    return None if names is None else set(names) | {n for n, alias in ALIASES.items() if alias in names}


def check_channel_inputs(args: ComposerGRPOConfig, columns: set[str] | None, *, hint_fn: bool) -> None:
    """Raise ``ValueError`` (one line naming the option and the fix) for a channel whose weight is > 0 but whose
    inputs a dataset with ``columns`` (None: unknown, e.g. an iterable dataset) and ``hint_fn`` cannot provide.
    The trainer runs it at construction; composer-train runs it before the model loads, and the trainer then finds
    the same config and columns checked (the check runs once per run)."""
    a, cols, ctx = args, columns, args.teacher_context_options
    key = (
        frozenset(cols or ()),
        hint_fn,
        a.alpha_sdpo,
        a.beta_replay,
        ctx.sdpo_teacher_context,
        a.replay_pairs,
    )
    if cols is None or getattr(a, "_composer_inputs_checked", None) == key:
        return
    if a.alpha_sdpo > 0 and not hint_fn and ctx.sdpo_teacher_context == "hint" and not cols & HINT_COLUMNS:
        raise ValueError(
            f"alpha_sdpo={a.alpha_sdpo} needs hints: a `hint` or `hinted_prompt` dataset column, or "
            "`hint_fn=`; provide one, set sdpo_teacher_context='success' (successful siblings teach, no hint "
            "needed) or set alpha_sdpo=0."
        )
    if a.alpha_sdpo > 0 and not hint_fn and ctx.uses_feedback and "privileged_context" not in cols:
        raise ValueError(
            f"sdpo_teacher_context={ctx.sdpo_teacher_context!r} needs the environment's feedback: `hint_fn=` (its "
            "text per completion is the feedback) or a `privileged_context` dataset column; provide one or use "
            "sdpo_teacher_context='success'."
        )
    if a.beta_replay > 0 and a.replay_pairs == "on_policy":
        check_on_policy_columns(cols)
    elif a.beta_replay > 0 and not cols >= PAIR_COLUMNS:
        raise ValueError(
            f"beta_replay={a.beta_replay} needs `chosen` and `rejected` dataset columns (the teacher trace and "
            f"the trace it beats); the dataset has {sorted(cols)}. Add them or set beta_replay=0."
        )
    a._composer_inputs_checked = key  # type: ignore[attr-defined]
