"""``ComposerGRPOTrainer``: TRL's ``GRPOTrainer`` computing composer's 3-channel objective.

Swap ``GRPOTrainer``/``GRPOConfig`` for ``ComposerGRPOTrainer``/``ComposerGRPOConfig``; everything else
(reward functions, datasets, PEFT, accelerate launch) stays TRL's. Per micro-batch::

    loss = w_policy · policy + alpha_sdpo · sdpo + beta_replay · replay

- **policy** (channel 1, ``w_policy`` = 1 by default; 0 is pure self-distillation: the student's forward still
  gives the log-probs and hidden states channel 2 needs, but the surrogate, its KL, its entropy / off-policy
  masks and its ``kl`` / ``clip_ratio`` metrics are not computed): TRL 1.16's GRPO loss for ``loss_type`` grpo/bnpo/dr_grpo/dapo — clipping
  (``epsilon``, ``epsilon_high``, ``delta``), k3 KL to the reference (``beta``), TRL's normalisers and
  gradient-accumulation scaling — computed by :func:`composer_core.loss.compose.compose_loss`, which follows
  TRL's op order: with ``alpha_sdpo = beta_replay = 0`` loss and gradients equal ``GRPOTrainer``'s
  bit for bit.
- **sdpo** (channel 2): the same model, without gradient, reads the *hinted* context (a ``hint`` or
  ``hinted_prompt`` column, or ``hint_fn`` built from the verifier's feedback on each completion) and
  teaches the plain-context student on the completion tokens of hinted rows. TRL's fused LM head only
  returns log-probs, so the trainer captures the student's last hidden state from that same forward
  (a forward hook on the backbone: no second student forward) and runs the teacher backbone; the
  full-vocabulary generalized JSD is computed chunk-wise from hidden states and the LM-head weight
  (:func:`composer_core.loss.distill.fused_linear_loss`), never materialising [B, T, V].
- **replay** (channel 3): DPO or SimPO on ``chosen``/``rejected`` completions of the prompt (text or
  token ids, optional ``chosen_mask``/``rejected_mask``); reference log-probs from ``ref_chosen_logps``
  /``ref_rejected_logps`` columns or a frozen reference (TRL's ref model, the PEFT base with adapters
  disabled, or a frozen copy of the initial policy), computed once per generation batch. With
  ``replay_pairs='on_policy'`` the rejected side is each failed completion of the group instead
  (:mod:`composer_trl.replay`).

Each channel is normalised by its own global count (tokens of hinted rows, pairs) over the accumulation
window and all processes, like TRL's ``dapo``, so gradient accumulation is exact.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from accelerate.utils import gather_object, is_peft_model
from composer_core.loss.compose import ComposerBatch
from composer_core.loss.config import TAID
from composer_core.loss.metrics import ADAPTER_PREFIX
from composer_core.loss.surrogates import log_importance_weights, vespo_weights
from composer_core.loss.wrappers import TAIDScheduler
from composer_core.sdpo import (
    TEACHER_STATE_FILE,
    TeacherContexts,
    build_teacher_contexts,
    cap_reprompt,
    ema_update_,
    ema_update_tensors_,
    frozen_copy,
    load_teacher,
    save_teacher,
)
from composer_core.traces.onpolicy import check_on_policy_columns
from torch import Tensor
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.data_utils import is_conversational
from trl.trainer.utils import get_config_model_id, nanmax, nanmin, pad, use_adapter

from composer_trl.config import ComposerGRPOConfig
from composer_trl.guards import (
    check_batch_prompts,
    deferred_trl_none_warning,
    emit,
    guarded_reward_funcs,
    reward_func_label,
    row_indices,
    unscored_batch_error,
)
from composer_trl.loss import Counts, channel_terms, composer_trl_loss
from composer_trl.recipe import HINT_COLUMNS, PAIR_COLUMNS
from composer_trl.replay import ChannelGradNorms, PairRow, logs_this_step, on_policy_rows

HintFn = Callable[..., Sequence[str | None]]
logger = logging.get_logger(__name__)

COMPOSER_COLUMNS = (
    "hint",
    "hinted_prompt",
    "chosen",
    "rejected",
    "chosen_mask",
    "rejected_mask",
    "ref_chosen_logps",
    "ref_rejected_logps",
    "privileged_context",  # TRL SDPOTrainer's feedback column (sdpo_teacher_context 'feedback' sources)
    # composer_core.traces.records (TraceRecord) names, accepted as aliases
    "teacher_prompt",
    "ref_chosen_logp",
    "ref_rejected_logp",
)
"""Dataset columns the trainer reads (kept through TRL's column removal). ``teacher_prompt``,
``ref_chosen_logp`` and ``ref_rejected_logp`` (the :mod:`composer_core.traces.records` trace-record schema) are
aliases of ``hinted_prompt``, ``ref_chosen_logps`` and ``ref_rejected_logps``."""

_ALIASES = {
    "hinted_prompt": "teacher_prompt",
    "ref_chosen_logps": "ref_chosen_logp",
    "ref_rejected_logps": "ref_rejected_logp",
}


def _get(row: dict[str, Any], key: str) -> Any:
    value = row.get(key)
    return row.get(_ALIASES[key]) if value is None and key in _ALIASES else value


_K = "composer_"  # prefix of the extra keys carried from generation to the loss
TEACHER_ADAPTER = "composer_sdpo_teacher"
"""The PEFT adapter that holds the ``sdpo_teacher='ema'`` teacher of a PEFT student."""


def _assistant_text(messages: list[dict[str, Any]], name: str) -> str:
    """The text a one-action message list is scored on; refuses what text scoring would drop.

    An action made of tool calls (``content`` None or empty, as in composer_core trace records of
    coding agents) would otherwise be scored on nothing but EOS, and a text + tool-call action on its
    prose only, so both raise instead of silently comparing the wrong thing.
    """
    texts = []
    for msg in messages:
        if msg.get("role") != "assistant":
            continue
        if msg.get("tool_calls"):
            raise ValueError(
                f"`{name}` holds an assistant message with tool calls, which are not rendered as text here "
                "(the pair would compare only the prose around them). Render the action with your chat "
                f"template and pass `{name}` as text or token ids (with `{name}_mask`), or drop the pair."
            )
        content = msg.get("content")
        if not isinstance(content, str):
            raise ValueError(
                f"`{name}` holds an assistant message whose content is {type(content).__name__}, not text; "
                f"pass `{name}` as text or token ids."
            )
        texts.append(content)
    if not texts:
        raise ValueError(f"`{name}` is a message list without an assistant message; pass the action's text.")
    return "".join(texts)


_GRPO_SIGNATURE = inspect.signature(GRPOTrainer.__init__)


class ComposerGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose loss is composer's 3-channel objective (see the module docstring).

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

    model: torch.nn.Module  # Trainer.__init__ sets it; never None in a constructed trainer

    def __init__(self, *args: Any, hint_fn: HintFn | None = None, **kwargs: Any) -> None:
        args, kwargs = _with_composer_config(args, kwargs)
        targs = kwargs["args"]
        if hint_fn is not None and not callable(hint_fn):
            raise ValueError(f"`hint_fn` must be callable, got {type(hint_fn).__name__}.")
        if hint_fn is not None and targs.teacher_context_options.sdpo_teacher_context == "success":
            raise ValueError(
                "`hint_fn` is not read with sdpo_teacher_context='success' (successful siblings are the only "
                "teacher context); use 'success+feedback' to add its text as feedback, or drop hint_fn."
            )
        super().__init__(*args, **kwargs)
        self.args: ComposerGRPOConfig
        self.hint_fn = hint_fn
        self._composer_window: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        self._taid: TAIDScheduler | None = None
        self._taid_pending: float | None = None
        self._replay_ref_model: torch.nn.Module | None = None
        self._replay_ref_source = "none"
        self._pair_token_cache: dict[str, list[int]] = {}  # text action → token ids (datasets repeat them)
        self._sdpo_teacher: torch.nn.Module | None = None  # the ema/base teacher's own weights (None: live)
        self._no_success_warned = False
        self._last_rewards_per_func: Tensor | None = None
        self._grad_norms = ChannelGradNorms()
        self._check_channel_inputs()
        self._check_head()
        if self.args.alpha_sdpo > 0:
            self._setup_sdpo_teacher()
        taid = self.args.compose_config.sdpo.wrapper
        if isinstance(taid, TAID):
            self._taid = TAIDScheduler(
                total_steps=int(self.args.max_steps),
                t_start=taid.t_start,
                t_end=taid.t_end,
                alpha=self.args.taid_alpha,
                beta=self.args.taid_momentum,
            )
            self.add_callback(_TAIDCallback(self))

    # ------------------------------------------------------------------ construction checks

    def _dataset_columns(self) -> set[str] | None:
        names = getattr(self.train_dataset, "column_names", None)
        if names is None:
            return None
        cols = set(names)
        return cols | {name for name, alias in _ALIASES.items() if alias in cols}

    def _check_channel_inputs(self) -> None:
        a = self.args
        cols = self._dataset_columns()
        check_channel_inputs(a, cols, hint_fn=self.hint_fn is not None)
        if a.beta_replay > 0 and a.dpo_variant == "dpo":
            has_cols = cols is not None and {"ref_chosen_logps", "ref_rejected_logps"} <= cols
            if a.replay_reference == "column" or (a.replay_reference == "auto" and has_cols):
                if not has_cols:
                    raise ValueError(
                        "replay_reference='column' needs `ref_chosen_logps` and `ref_rejected_logps` columns "
                        "(summed reference log-probs); add them or use replay_reference='model'."
                    )
                self._replay_ref_source = "column"
            elif self.ref_model is not None:
                self._replay_ref_source = "ref_model"
            elif is_peft_model(self.model):
                self._replay_ref_source = "peft_base"
            else:
                # A frozen copy of the initial policy (TRL builds no ref model when beta == 0).
                ref = copy.deepcopy(self.model).eval()
                for p in ref.parameters():
                    p.requires_grad_(False)
                self._replay_ref_model = self.accelerator.prepare_model(ref, evaluation_mode=True)
                self._replay_ref_source = "frozen_copy"

    def _setup_sdpo_teacher(self) -> None:
        """``sdpo_teacher``: live (the student), base (a frozen copy; PEFT: adapters off) or ema (a copy updated
        by :class:`_SDPOTeacherCallback`). The copy is saved with every checkpoint and restored on resume."""
        kind = self.args.teacher_weights_options.sdpo_teacher
        if kind == "live" or (kind == "base" and is_peft_model(self.model)):
            return
        if is_peft_model(self.model):
            self._add_teacher_adapter()
        else:
            teacher = frozen_copy(self.accelerator.unwrap_model(self.model))
            self._sdpo_teacher = self.accelerator.prepare_model(teacher, evaluation_mode=True)
        self.add_callback(_SDPOTeacherCallback(self))

    def _add_teacher_adapter(self) -> None:
        """PEFT + ``ema``: the teacher is a second adapter (:data:`TEACHER_ADAPTER`) on the same base, a frozen
        copy of the student's adapter updated by EMA (an EMA of the adapter only: no copy of the base weights)."""
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        peft_model = self.accelerator.unwrap_model(self.model)
        active = peft_model.active_adapter
        peft_model.add_adapter(TEACHER_ADAPTER, peft_model.peft_config[active])
        student_state = get_peft_model_state_dict(peft_model, adapter_name=active)
        set_peft_model_state_dict(peft_model, student_state, adapter_name=TEACHER_ADAPTER)
        peft_model.set_adapter(active)  # the student's adapter stays the trained one
        pairs = self._adapter_pairs()
        if not pairs:
            raise ValueError(
                "sdpo_teacher='ema' found no trainable adapter weights in this PEFT model to average; use "
                "sdpo_teacher='base' or 'live'."
            )
        for teacher, _ in pairs.values():
            teacher.requires_grad_(False)

    def _adapter_pairs(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{teacher adapter parameter name: (teacher tensor, student tensor)}`` of the PEFT ``ema`` teacher."""
        peft_model = self.accelerator.unwrap_model(self.model)
        active = f".{peft_model.active_adapter}."
        params = dict(peft_model.named_parameters())
        pairs: dict[str, tuple[Tensor, Tensor]] = {}
        for name, p in params.items():
            if f".{TEACHER_ADAPTER}." in name:
                student = params.get(name.replace(f".{TEACHER_ADAPTER}.", active))
                if student is not None:
                    pairs[name] = (p, student)
        return pairs

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self._sdpo_teacher is not None:
            load_teacher(self.accelerator.unwrap_model(self._sdpo_teacher), resume_from_checkpoint)
        elif (
            self.args.teacher_weights_options.sdpo_teacher == "ema" and self.args.alpha_sdpo > 0
        ):  # PEFT: the teacher adapter
            from safetensors.torch import load_file

            path = os.path.join(resume_from_checkpoint, TEACHER_STATE_FILE)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} is missing: the checkpoint holds no EMA teacher adapter.")
            state = load_file(path)
            with torch.no_grad():
                for name, (teacher, _) in self._adapter_pairs().items():
                    teacher.copy_(state[name])

    def _check_head(self) -> None:
        if self.args.alpha_sdpo == 0 or self.args.sdpo_form == "sampled":
            return
        base = self._base_model(self.model)
        head = base.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear):
            raise ValueError(
                f"sdpo_form={self.args.sdpo_form!r} reads the LM-head weight directly, but the output embedding is a "
                f"{type(head).__name__} (e.g. LoRA on lm_head); exclude lm_head from the adapter or use "
                "sdpo_form='sampled'."
            )
        text_cfg = base.config.get_text_config()
        for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier", "logits_scaling"):
            value = getattr(text_cfg, attr, None)
            if value not in (None, 1.0):
                raise ValueError(
                    f"sdpo_form={self.args.sdpo_form!r} projects hidden states with the plain LM head, but this model's config "
                    f"sets {attr}={value!r}; use sdpo_form='sampled' for it."
                )

    @staticmethod
    def _base_model(model: Any) -> Any:
        while hasattr(model, "module") and not hasattr(model, "get_output_embeddings"):
            model = model.module  # DDP / accelerate wrappers
        if is_peft_model(model):
            model = model.get_base_model()  # LoRA layers are injected in place: the base runs them
        return model

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

        with deferred_trl_none_warning() as held, guarded_reward_funcs(self, rows, step):
            rewards_per_func: Tensor = super()._calculate_rewards(
                inputs, prompts, completions, completion_ids_list
            )
        labels = [reward_func_label(f, n) for f, n in zip(self.reward_funcs, self.reward_func_names)]
        unscored = unscored_batch_error(rewards_per_func, labels, rows, step)
        if unscored is not None:  # every completion is TRL's "All reward functions returned None" case
            raise unscored
        emit(held)  # TRL's warning for the rows no function scored
        self._last_rewards_per_func = rewards_per_func  # gathered over processes: the group's successes
        return rewards_per_func

    def _generate(self, prompts: list[Any]) -> Any:
        self._composer_check_prompts = True  # the batch's prompts: checked against the context once tokenized
        try:
            return super()._generate(prompts)
        finally:
            self._composer_check_prompts = False

    def _tokenize_prompts(self, prompts: list[Any]) -> Any:
        tokenized = super()._tokenize_prompts(prompts)
        if getattr(self, "_composer_check_prompts", False):  # not the SDPO teacher contexts
            self._composer_check_prompts = False
            check_batch_prompts(self, prompts, tokenized[0])
        return tokenized

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        if self.args.alpha_sdpo > 0 and self.args.teacher_context_options.sdpo_teacher_context != "hint":
            output.update(self._build_group_contexts(inputs, output, mode))
        elif self.args.alpha_sdpo > 0:
            output.update(self._build_hints(inputs, output))
        if self.args.beta_replay > 0:
            output.update(self._build_pairs(inputs, output, mode))
        return output

    def _completion_texts(self, output: dict[str, Any]) -> list[str]:
        ids, mask = output["completion_ids"], output["completion_mask"]
        rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        texts: list[str] = self._tokenizer.batch_decode(rows, skip_special_tokens=True)
        return texts

    def _build_hints(self, inputs: list[dict[str, Any]], output: dict[str, Any]) -> dict[str, Any]:
        prompts = [x["prompt"] for x in inputs]
        if self.hint_fn is not None:
            hints = self._call_hint_fn(inputs, output, "hints")
            hinted: list[Any | None] = [
                None if h is None else self._apply_hint(p, h) for p, h in zip(prompts, hints)
            ]
        else:
            hinted = []
            for x in inputs:
                if _get(x, "hinted_prompt") is not None:
                    hinted.append(_get(x, "hinted_prompt"))
                elif x.get("hint") is not None:
                    hinted.append(self._apply_hint(x["prompt"], x["hint"]))
                else:
                    hinted.append(None)
        for h in hinted:
            if h is not None and not isinstance(h, str | list):
                raise ValueError(f"a hint must be a string (or a chat message list), got {type(h).__name__}.")
        return self._teacher_tensors(hinted, output)

    def _teacher_tensors(self, contexts: list[Any | None], output: dict[str, Any]) -> dict[str, Any]:
        """The teacher prompts (None: not distilled) tokenised, left-padded, capped at ``max_reprompt_len``."""
        device = self.accelerator.device
        has_hint = torch.tensor([h is not None for h in contexts], device=device)
        rows = [i for i, h in enumerate(contexts) if h is not None]
        ids_list = [torch.full((1,), self._tokenizer.pad_token_id)] * len(contexts)
        mask_list = [torch.zeros(1, dtype=torch.long)] * len(contexts)
        if rows:
            max_len = self.args.teacher_context_options.max_reprompt_len
            tok_ids, _, _ = self._tokenize_prompts([contexts[i] for i in rows])
            for i, ids in zip(rows, tok_ids):
                ids = cap_reprompt(ids, max_len)
                ids_list[i] = torch.tensor(ids)
                mask_list[i] = torch.ones(len(ids), dtype=torch.long)
        hint_ids = pad(ids_list, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        hint_mask = pad(mask_list, padding_value=0, padding_side="left").to(device)
        loss_mask = output["completion_mask"]
        if "tool_mask" in output:
            loss_mask = loss_mask * output["tool_mask"]
        # seq_mean: normalised by rows, distilled or not (TRL SDPOTrainer)
        if self.args.compose_config.sdpo.loss_agg == "seq_mean":
            local = torch.tensor(float(len(contexts)), device=device)
        else:
            local = (loss_mask * has_hint.unsqueeze(1)).sum()
        return {
            f"{_K}hint_ids": hint_ids,
            f"{_K}hint_mask": hint_mask,
            f"{_K}has_hint": has_hint,
            f"{_K}sdpo_num_items": self.accelerator.gather(local).sum(),
        }

    def _group_rewards(self) -> list[float]:
        """The weighted reward of every completion of the generation batch (all processes; NaN: unscorable)."""
        rpf = self._last_rewards_per_func
        assert rpf is not None, "GRPOTrainer computed no rewards before the teacher contexts"
        rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rpf).all(dim=1)] = torch.nan
        return [float(r) for r in rewards.tolist()]

    def _feedback(self, inputs: list[dict[str, Any]], output: dict[str, Any]) -> list[str | None]:
        """The environment's feedback per completion: ``hint_fn``'s text, else the ``privileged_context`` column."""
        if self.hint_fn is None:
            return [x.get("privileged_context") for x in inputs]
        return self._call_hint_fn(inputs, output, "feedback texts")

    def _call_hint_fn(self, inputs: list[dict[str, Any]], output: dict[str, Any], what: str) -> list[Any]:
        """``hint_fn(prompts=, completions=, completion_ids=, **columns)``: one value per completion."""
        assert self.hint_fn is not None
        columns = {k: [x.get(k) for x in inputs] for k in inputs[0] if k not in ("prompt", "completion")}
        values = list(
            self.hint_fn(
                prompts=[x["prompt"] for x in inputs],
                completions=self._completion_texts(output),
                completion_ids=output["completion_ids"],
                **columns,
            )
        )
        if len(values) != len(inputs):
            raise ValueError(f"hint_fn returned {len(values)} {what} for {len(inputs)} completions.")
        return values

    def _build_group_contexts(
        self, inputs: list[dict[str, Any]], output: dict[str, Any], mode: str
    ) -> dict[str, Any]:
        """Teacher contexts from the group's successful siblings and/or feedback (``composer_core.sdpo``), built
        over the whole generation batch (every process) so a group split across processes sees all its rows."""
        opts = self.args.teacher_context_options  # built (checked) once per call: a few dataclass fields
        pad_id = self._tokenizer.pad_token_id
        demos = self._tokenizer.batch_decode(
            [row[row != pad_id].tolist() for row in output["completion_ids"]], skip_special_tokens=True
        )
        feedback = self._feedback(inputs, output) if opts.uses_feedback else None
        ctx = group_contexts(
            self.args,
            gather_object([x["prompt"] for x in inputs]),
            gather_object(demos),
            self._group_rewards(),
            self._group_size(mode),
            None if feedback is None else gather_object(feedback),
        )
        self._log_contexts(mode, ctx)
        start = self.accelerator.process_index * len(inputs)
        return self._teacher_tensors(ctx.contexts[start : start + len(inputs)], output)

    def _group_size(self, mode: str) -> int:
        size = self.num_generations if mode == "train" else self.num_generations_eval
        assert size is not None  # GRPOTrainer sets both
        return int(size)

    def _log_contexts(self, mode: str, ctx: TeacherContexts) -> None:
        for key, value in ctx.metrics.items():
            self._metrics[mode][f"{ADAPTER_PREFIX}sdpo/{key}"].append(value)
        a = self.args.teacher_context_options
        if (
            a.sdpo_teacher_context != "feedback"
            and ctx.groups_with_success == 0
            and not self._no_success_warned
        ):
            self._no_success_warned = True
            logger.warning(
                f"success_reward_threshold={a.success_reward_threshold}: none of the {ctx.groups} groups of this "
                "generation batch has a completion that reached it, so no row had a successful sibling to learn "
                "from (warned once per run; composer/sdpo/success_group_fraction logs it every step). Lower the "
                "threshold if your rewards cannot reach it."
            )

    def _apply_hint(self, prompt: Any, hint: str) -> Any:
        if not isinstance(hint, str):
            raise ValueError(f"a hint must be a string, got {type(hint).__name__}.")
        if is_conversational({"prompt": prompt}):
            messages = [dict(m) for m in prompt]
            last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
            if last_user is None:
                raise ValueError("a chat prompt needs a user message to attach the hint to.")
            messages[last_user]["content"] = f"{messages[last_user]['content']}\n\n{hint}"
            return messages
        return self.args.hint_template.format(hint=hint, prompt=prompt)

    def _pair_ids(self, value: Any, mask: Any, name: str) -> tuple[list[int], list[int]]:
        limit = self.args.max_replay_length or self.args.max_completion_length
        if isinstance(value, str):
            ids = self._text_ids(value)
            m = [1] * len(ids)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            return self._pair_ids(_assistant_text(value, name), mask, name)
        elif isinstance(value, list) and all(isinstance(t, int) for t in value):
            ids = list(value)
            m = [1] * len(ids) if mask is None else [int(bool(v)) for v in mask]
        else:
            raise ValueError(
                f"`{name}` must be text, a list of token ids or assistant messages, got {value!r:.80}."
            )
        if mask is not None and isinstance(value, str):
            raise ValueError(
                f"`{name}_mask` needs `{name}` as a list of token ids (a mask of text is ambiguous)."
            )
        if len(m) != len(ids):
            raise ValueError(f"`{name}_mask` has {len(m)} entries for {len(ids)} tokens of `{name}`.")
        ids, m = ids[:limit], m[:limit]
        if not any(m):
            raise ValueError(
                f"`{name}` has no scored token (empty or fully masked); fix the row or drop the pair."
            )
        return ids, m

    def _text_ids(self, text: str) -> list[int]:
        """Token ids of a text action (+ EOS per ``replay_append_eos``), tokenised once per distinct text."""
        ids = self._pair_token_cache.get(text)
        if ids is None:
            ids = list(self._tokenizer(text=text, add_special_tokens=False)["input_ids"])
            if self.args.replay_append_eos and self._tokenizer.eos_token_id is not None:
                ids.append(self._tokenizer.eos_token_id)
            if len(self._pair_token_cache) >= 100_000:
                self._pair_token_cache.clear()
            self._pair_token_cache[text] = ids
        return list(ids)

    def _column_rows(
        self, inputs: list[dict[str, Any]], mode: str
    ) -> tuple[list[PairRow | None], list[bool]]:
        """``replay_pairs='columns'``: the dataset's chosen/rejected, once per prompt (its group's first row)."""
        g = self._group_size(mode)
        offset = self.accelerator.process_index * len(inputs)
        rows: list[PairRow | None] = []
        for i, x in enumerate(inputs):
            # Each prompt appears num_generations times in a generation batch: keep its pair once.
            present = x.get("chosen") is not None and x.get("rejected") is not None
            if not (present and (offset + i) % g == 0):
                rows.append(None)
                continue
            ci, cm = self._pair_ids(x["chosen"], x.get("chosen_mask"), "chosen")
            ri, rm = self._pair_ids(x["rejected"], x.get("rejected_mask"), "rejected")
            rows.append((ci, cm, [1] * len(ci), ri, rm, [1] * len(ri)))
        return rows, [r is not None for r in rows]

    def _build_pairs(self, inputs: list[dict[str, Any]], output: dict[str, Any], mode: str) -> dict[str, Any]:
        device = self.accelerator.device
        pad_id = self._tokenizer.pad_token_id
        on_policy = self.args.replay_pairs == "on_policy"
        found, has_pair = (
            on_policy_rows(self, inputs, output, mode) if on_policy else self._column_rows(inputs, mode)
        )
        empty: PairRow = ([pad_id], [0], [0], [pad_id], [0], [0])
        rows = [empty if r is None else r for r in found]
        column = self._replay_ref_source == "column"
        ref_cols = [
            (_finite(x, "ref_chosen_logps"), _finite(x, "ref_rejected_logps"))
            if column and has
            else (0.0, 0.0)
            for x, has in zip(inputs, has_pair)
        ]
        chosen, c_mask, c_attn, rejected, r_mask, r_attn = (list(col) for col in zip(*rows))
        width = max(len(t) for t in chosen + rejected)

        def to_tensor(rows: list[list[int]], value: int) -> Tensor:
            return torch.tensor([r + [value] * (width - len(r)) for r in rows], device=device)

        out: dict[str, Any] = {
            f"{_K}chosen_ids": to_tensor(chosen, pad_id),
            f"{_K}chosen_mask": to_tensor(c_mask, 0),
            f"{_K}chosen_attn": to_tensor(c_attn, 0),
            f"{_K}rejected_ids": to_tensor(rejected, pad_id),
            f"{_K}rejected_mask": to_tensor(r_mask, 0),
            f"{_K}rejected_attn": to_tensor(r_attn, 0),
            f"{_K}has_pair": torch.tensor(has_pair, device=device),
        }
        out[f"{_K}replay_num_items"] = self.accelerator.gather(out[f"{_K}has_pair"].sum()).sum()
        if self.args.dpo_variant == "dpo":
            if self._replay_ref_source == "column":
                ref = torch.tensor(ref_cols, dtype=torch.float32, device=device)
            else:
                ref = self._reference_pair_logps(output, out)
            out[f"{_K}ref_chosen_logps"] = ref[:, 0]
            out[f"{_K}ref_rejected_logps"] = ref[:, 1]
        return out

    @torch.no_grad()
    def _reference_pair_logps(self, output: dict[str, Any], pairs: dict[str, Any]) -> Tensor:
        rows = pairs[f"{_K}has_pair"].nonzero().squeeze(-1)
        result = torch.zeros(len(pairs[f"{_K}has_pair"]), 2, device=self.accelerator.device)
        if rows.numel() == 0:
            return result
        ctx: AbstractContextManager[Any]
        model: torch.nn.Module | None
        if self._replay_ref_source == "ref_model":
            ctx, model = nullcontext(), self.ref_model
        elif self._replay_ref_source == "peft_base":
            unwrapped = self.accelerator.unwrap_model(self.model)
            ctx, model = use_adapter(unwrapped, adapter_name=None), self.model
        else:
            ctx, model = nullcontext(), self._replay_ref_model
        with ctx:
            c, r = self._pair_logps(model, output, pairs, rows)
        result[rows, 0] = c.float()
        result[rows, 1] = r.float()
        return result

    def _pair_logps(
        self, model: Any, inputs: dict[str, Any], pairs: dict[str, Any], rows: Tensor, sides: int = 2
    ) -> tuple[Tensor, Tensor]:
        """Summed log-probs of chosen and rejected after the prompt, one forward over [2P, P_len + L]
        (``sides=1``: the chosen rows only, [P, ...]; the rejected sums returned are then empty)."""
        p_ids, p_mask = inputs["prompt_ids"][rows], inputs["prompt_mask"][rows]
        names = ("chosen", "rejected")[:sides]
        pair_ids = torch.cat([pairs[f"{_K}{s}_ids"][rows] for s in names], dim=0)
        # Attend over every real token; score only the masked ones.
        pair_attn = torch.cat([pairs[f"{_K}{s}_attn"][rows] for s in names], dim=0)
        input_ids = torch.cat([torch.cat([p_ids] * sides, dim=0), pair_ids], dim=1)
        attention = torch.cat([torch.cat([p_mask] * sides, dim=0), pair_attn], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(model, input_ids, attention, pair_ids.size(1))
        summed = (logps * torch.cat([pairs[f"{_K}{s}_mask"][rows] for s in names], dim=0)).sum(-1)
        n = rows.numel()
        return summed[:n], summed[n:]

    # ------------------------------------------------------------------ the loss

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        a = self.args
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

        want_sdpo = a.alpha_sdpo > 0 and bool(inputs.get(f"{_K}has_hint", torch.zeros(1)).any())
        want_replay = a.beta_replay > 0 and bool(inputs.get(f"{_K}has_pair", torch.zeros(1)).any())
        # The chosen/rejected rows ride in the student's forward (one forward over [B + 2P] rows) unless
        # the MoE aux loss is on: TRL's router loss must see the policy rows only.
        on_policy = a.replay_pairs == "on_policy"
        merged = (
            _MergedPairs(inputs, logits_to_keep, self._tokenizer.pad_token_id, sides=1 if on_policy else 2)
            if (want_replay and not self.aux_loss_enabled)
            else None
        )
        if merged is not None:
            input_ids, attention_mask = merged.input_ids(input_ids), merged.attention(attention_mask)
        capture = _HiddenCapture(self._base_model(model)) if want_sdpo and a.sdpo_form != "sampled" else None
        with capture if capture is not None else nullcontext():
            per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                merged.width if merged is not None else logits_to_keep,
                compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled,
            )
        if merged is not None:
            pair_logps = per_token_logps
            per_token_logps, entropies = merged.policy(per_token_logps), merged.policy(entropies)
            if capture is not None and capture.hidden is not None:
                capture.hidden = merged.policy_hidden(capture.hidden)

        # w_policy=0 (pure self-distillation): no surrogate, so neither its masks nor its KL / clip metrics
        pure = a.w_policy == 0
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
            sdpo_items=inputs.get(f"{_K}sdpo_num_items") if want_sdpo else None,
            replay_items=inputs.get(f"{_K}replay_num_items"),
            num_processes=self.accelerator.num_processes,
            accumulation=self.current_gradient_accumulation_steps if training else 1,
            steps_per_generation=self.args.steps_per_generation if training else 1,  # type: ignore[arg-type]  # int after GRPOConfig.__post_init__
        )
        loss, result = composer_trl_loss(
            batch, a, counts, taid_t=self._taid.t if self._taid is not None else None
        )
        if training and a.log_channel_grad_norms and logs_this_step(self):
            policy, sdpo, replay = channel_terms(result, a, counts)
            self._grad_norms.add(model, {
                "policy": None if policy is None else a.w_policy * policy,
                "sdpo": None if sdpo is None else a.alpha_sdpo * sdpo,
                "replay": None if replay is None else a.beta_replay * replay,
            })  # fmt: skip
            if self.accelerator.sync_gradients:
                self._grad_norms.log(self)
        policy = channel_terms(result, a, counts)[0]
        policy = (
            torch.zeros((), device=loss.device) if policy is None else policy.detach()
        )  # None: w_policy=0
        bonus_mask = mask if entropy_mask is None else mask * entropy_mask
        bonus = self._entropy_bonus(entropies, bonus_mask, mode, policy)
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

    def _fill_sdpo(
        self,
        batch: ComposerBatch,
        model: Any,
        inputs: dict[str, Any],
        mask: Tensor,
        capture: _HiddenCapture | None,
        logits_to_keep: int,
    ) -> None:
        has_hint = inputs[f"{_K}has_hint"]
        rows = has_hint.nonzero().squeeze(-1)
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        t_ids = torch.cat([inputs[f"{_K}hint_ids"][rows], completion_ids[rows]], dim=1)
        t_mask = torch.cat([inputs[f"{_K}hint_mask"][rows], completion_mask[rows]], dim=1)
        batch.sdpo_mask = mask.bool() & has_hint.unsqueeze(1)
        teacher_model = model if self._sdpo_teacher is None else self._sdpo_teacher
        if self.args.sdpo_form == "sampled":
            with torch.no_grad(), self._teacher_weights():
                t_logps, _, _ = self._get_per_token_logps_and_entropies(
                    teacher_model, t_ids, t_mask, logits_to_keep
                )
            teacher = torch.zeros_like(batch.logprobs)
            teacher[rows] = t_logps.to(teacher.dtype)
            batch.teacher_logprobs = teacher
            return
        assert capture is not None and capture.hidden is not None
        base = self._base_model(model)
        t_base = base if self._sdpo_teacher is None else self._base_model(self._sdpo_teacher)
        student_hidden = capture.hidden[:, -logits_to_keep - 1 : -1]
        # the student's forward runs under autocast too
        with torch.no_grad(), self.accelerator.autocast(), self._teacher_weights():
            t_out = t_base.base_model(input_ids=t_ids, attention_mask=t_mask, use_cache=False)
            t_hidden = t_out.last_hidden_state[:, -logits_to_keep - 1 : -1]
        teacher_hidden = torch.zeros_like(student_hidden)
        teacher_hidden[rows] = t_hidden.to(teacher_hidden.dtype)
        head, t_head = base.get_output_embeddings(), t_base.get_output_embeddings()
        if self.args.sdpo_form == "topk":  # [B, T, V] logits, as TRL's SDPOTrainer computes them
            batch.student_logits = head(student_hidden)
            with torch.no_grad():
                batch.teacher_logits = t_head(teacher_hidden)
            return
        batch.student_hidden = student_hidden
        batch.teacher_hidden = teacher_hidden
        batch.lm_head_weight = head.weight
        batch.lm_head_bias = head.bias
        if t_base is not base:
            batch.teacher_lm_head_weight = t_head.weight
            batch.teacher_lm_head_bias = t_head.bias

    def _teacher_weights(self) -> AbstractContextManager[Any]:
        """PEFT: the ``base`` teacher reads the base weights (adapters off), the ``ema`` teacher its own adapter;
        other teachers need nothing."""
        kind = self.args.teacher_weights_options.sdpo_teacher
        if is_peft_model(self.model) and kind != "live":
            name = None if kind == "base" else TEACHER_ADAPTER
            return use_adapter(self.accelerator.unwrap_model(self.model), adapter_name=name)
        return nullcontext()

    def _fill_replay(
        self,
        batch: ComposerBatch,
        model: Any,
        inputs: dict[str, Any],
        sums: tuple[Tensor, Tensor] | None = None,
        policy_logps: Tensor | None = None,
    ) -> None:
        """Channel-3 inputs; ``sums``: the pairs' summed log-probs when the student's forward computed them;
        ``policy_logps`` [B, T] (on-policy pairs): the rejected side is the row's own completion, summed from it."""
        rows = inputs[f"{_K}has_pair"].nonzero().squeeze(-1)
        sides = 1 if policy_logps is not None else 2
        chosen, rejected = sums if sums is not None else self._pair_logps(model, inputs, inputs, rows, sides)
        if policy_logps is not None:
            t = policy_logps.size(1)
            rejected = (policy_logps[rows] * inputs[f"{_K}rejected_mask"][rows, :t]).sum(-1)
        batch.chosen_logps, batch.rejected_logps = chosen, rejected
        batch.chosen_lengths = inputs[f"{_K}chosen_mask"][rows].sum(-1)
        batch.rejected_lengths = inputs[f"{_K}rejected_mask"][rows].sum(-1)
        if self.args.dpo_variant == "dpo":
            batch.ref_chosen_logps = inputs[f"{_K}ref_chosen_logps"][rows].to(chosen.dtype)
            batch.ref_rejected_logps = inputs[f"{_K}ref_rejected_logps"][rows].to(rejected.dtype)

    # ------------------------------------------------------------------ metrics

    def _log_trl_metrics(
        self,
        mode: str,
        logps: Tensor,
        entropies: Tensor,
        mask: Tensor,
        inputs: dict[str, Any],
        *,
        policy: bool,
    ) -> None:
        """The metrics plain GRPOTrainer logs from its loss, same names and values: ``kl`` (bias-corrected when
        TRL's ``use_bias_correction_kl`` is), ``entropy``, and by loss type ``clip_ratio/*`` (the clip family),
        ``cispo_clip_ratio`` or ``vespo/phi_seq_mean`` (``aux_loss`` for MoE models and ``policy_loss`` /
        ``entropy_coef`` with the entropy bonus are logged in :meth:`_compute_loss`). ``policy=False``
        (``w_policy=0``): ``entropy`` only."""

        def global_masked_mean(x: Tensor) -> float:
            if x.shape[1] == 1:  # sequence level: one value per sequence
                local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
            else:
                local = torch.stack([(x * mask).sum(), mask.sum().float()])
            totals = self.accelerator.reduce(local, reduction="sum")
            return float((totals[0] / totals[1].clamp(min=1.0)).item())

        def masked_seq_mean(x: Tensor) -> Tensor:  # NaN for an empty row, skipped by nanmin/nanmax (TRL)
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        m = self._metrics[mode]
        m["entropy"].append(global_masked_mean(entropies.detach()))
        if not policy:
            return
        old = inputs.get("old_per_token_logps")
        log_ratio = logps.detach() - (logps.detach() if old is None else old)
        coef = torch.exp(log_importance_weights(log_ratio, mask, self.importance_sampling_level))
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            kl = torch.exp(ref - logps.detach()) - (ref - logps.detach()) - 1
            if self.args.use_bias_correction_kl:
                kl = kl * coef
            m["kl"].append(global_masked_mean(kl))
        adv = inputs["advantages"].unsqueeze(1) if inputs["advantages"].dim() == 1 else inputs["advantages"]
        if self.loss_type == "cispo":
            m["cispo_clip_ratio"].append(global_masked_mean(((coef > self.epsilon_high) & (adv > 0)).float()))
        elif self.loss_type == "vespo":
            a = self.args
            shape = (a.vespo_k_pos, a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg)
            phi = vespo_weights(adv, log_ratio, mask, inputs.get("importance_sampling_ratio"), *shape)
            m["vespo/phi_seq_mean"].append(global_masked_mean(phi))
        elif self.loss_type != "sapo":
            low = ((coef < 1 - self.epsilon_low) & (adv < 0)).float()
            high = ((coef > 1 + self.epsilon_high) & (adv > 0)).float()
            m["clip_ratio/low_mean"].append(global_masked_mean(low))
            m["clip_ratio/high_mean"].append(global_masked_mean(high))
            m["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(low, high)))
            m["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(low))).item())
            m["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(high))).item())

    def _surrogate_masks(
        self, logps: Tensor, entropies: Tensor, mask: Tensor, inputs: dict[str, Any]
    ) -> tuple[Tensor | None, Tensor | None]:
        """TRL's high-entropy token mask (``top_entropy_quantile``) and off-policy sequence mask
        (``off_policy_mask_threshold``), computed by GRPOTrainer's own methods: (their product, the entropy mask)."""
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        keep = entropy_mask
        if self.off_policy_mask_threshold is not None:
            adv = (
                inputs["advantages"].unsqueeze(1) if inputs["advantages"].dim() == 1 else inputs["advantages"]
            )
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            off = self.get_off_policy_mask(
                advantages=adv,
                per_token_logps=logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
            keep = off if keep is None else off * keep
        return keep, entropy_mask

    def _entropy_bonus(self, entropies: Tensor, mask: Tensor, mode: str, policy: Tensor) -> Tensor | None:
        """TRL's entropy bonus ``coef · H`` (H the mean entropy over ``mask``, scaled for accumulation), to subtract
        from the loss; ``use_adaptive_entropy`` moves ``coef`` once per optimiser step from the window's entropy."""
        if not self._entropy_bonus_enabled:
            return None
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        h = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        coef = self.entropy_coef
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            coef = 0.0
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            self._adapt_entropy_coef(torch.stack([(entropies * mask).sum(), mask.sum()]).detach())
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return coef * h

    def _adapt_entropy_coef(self, stats: Tensor) -> None:
        """Accumulate (Σ entropy, tokens) over the window; at its end move ``entropy_coef`` by ``entropy_coef_delta``
        towards ``entropy_target`` from the global mean, within [``entropy_coef_min``, ``entropy_coef_max``]."""
        window: Tensor | None = self._entropy_window_stats
        window = stats if window is None else window + stats
        self._entropy_window_stats = window  # type: ignore[assignment]  # TRL declares it None at construction
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(window, reduction="sum")
        world = (totals[0] / totals[1].clamp(min=1.0)).item()
        a = self.args
        if world <= a.entropy_target:
            self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min)
        self._last_world_entropy = world
        self._entropy_window_stats = None

    def _log_composer_metrics(self, mode: str, policy: Tensor, result: Any, total: Tensor) -> None:
        """Accumulate each channel's contribution over the accumulation window; log once per optimiser step.

        Logged (TRL's console / TensorBoard / W&B) under ``composer/`` + composer_core's ``METRIC_KEYS``:
        ``composer/loss/policy``, ``composer/loss/sdpo``, ``composer/loss/replay`` (unweighted channel losses,
        0 for a skipped channel), ``composer/loss/total``, ``composer/sdpo/skipped`` and
        ``composer/replay/skipped`` (micro-batches, summed over processes), ``composer/sdpo/tokens``,
        ``composer/replay/pairs``, ``composer/replay/accuracy`` and ``composer/taid/t``. The ``policy/*`` keys
        are not repeated: TRL logs its own (``kl``, ``clip_ratio/*``).
        """
        m = result.metrics
        w = self._composer_window
        step = {
            "loss/policy": policy.double().cpu(),
            "loss/total": total.double().cpu(),
            "loss/sdpo": 0.0 if result.sdpo is None else float(result.sdpo.detach()),
            "loss/replay": 0.0 if result.replay is None else float(result.replay.detach()),
            "sdpo/skipped": m.get("sdpo/skipped", 1.0),
            "replay/skipped": m.get("replay/skipped", 1.0),
            "sdpo/tokens": m.get("sdpo/tokens", 0.0),
            "replay/pairs": m.get("replay/pairs", 0.0),
            "replay/correct": m.get("replay/accuracy", 0.0) * m.get("replay/pairs", 0.0),
        }
        for k, v in step.items():
            w[k] = w[k] + v
        if mode == "train" and not self.accelerator.sync_gradients:
            return
        keys = sorted(w)
        local = torch.stack([w[k] for k in keys]).to(self.accelerator.device, torch.float64)
        summed = self.accelerator.reduce(local, reduction="sum")
        vals = dict(zip(keys, summed.tolist()))
        n = self.accelerator.num_processes
        for k in ("loss/policy", "loss/sdpo", "loss/replay", "loss/total"):
            self._metrics[mode][ADAPTER_PREFIX + k].append(vals[k] / n)
        for k in ("sdpo/skipped", "replay/skipped", "sdpo/tokens", "replay/pairs"):
            self._metrics[mode][ADAPTER_PREFIX + k].append(vals[k])
        if vals["replay/pairs"] > 0:
            self._metrics[mode][ADAPTER_PREFIX + "replay/accuracy"].append(
                vals["replay/correct"] / vals["replay/pairs"]
            )
        if self._taid is not None:
            self._metrics[mode][ADAPTER_PREFIX + "taid/t"].append(self._taid.t)
            if mode == "train":
                self._taid_pending = vals["loss/sdpo"] / n
        self._composer_window.clear()


# introspection shows GRPOTrainer's parameters (positional order included) plus the keyword-only ``hint_fn``
ComposerGRPOTrainer.__init__.__signature__ = _GRPO_SIGNATURE.replace(  # type: ignore[attr-defined]
    parameters=[
        *_GRPO_SIGNATURE.parameters.values(),
        inspect.Parameter("hint_fn", inspect.Parameter.KEYWORD_ONLY, default=None),
    ]
)


class _TAIDCallback(TrainerCallback):
    """Advances TAID's t once per optimiser step (``on_step_end``, never during evaluation) from the globally
    reduced SDPO loss of that step."""

    def __init__(self, trainer: ComposerGRPOTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        t = self.trainer
        if t._taid is not None and t._taid_pending is not None:
            t._taid.step(t._taid_pending)
            t._taid_pending = None
        return control


def _with_composer_config(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """GRPOTrainer's arguments, every positional one bound by name as ``GRPOTrainer.__init__`` binds it (so
    positional and keyword construction are the same call), with ``args`` made a :class:`ComposerGRPOConfig`:
    ``None`` → TRL's default config (``"<model>-GRPO"``), a plain ``GRPOConfig`` → its options with the channels
    off (a plain swap)."""
    kwargs = _GRPO_SIGNATURE.bind(None, *args, **kwargs).arguments  # TypeError as GRPOTrainer raises it
    del kwargs["self"]
    args = ()
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
    return args, kwargs


def check_channel_inputs(args: ComposerGRPOConfig, columns: set[str] | None, *, hint_fn: bool) -> None:
    """Raise ``ValueError`` (one line naming the option and the fix) for a channel whose weight is > 0 but whose
    inputs a dataset with ``columns`` (None: unknown, e.g. an iterable dataset) and ``hint_fn`` cannot provide.
    The trainer runs it at construction and ``composer-train`` before it loads the model or writes anything."""
    a, cols = args, columns
    source = a.teacher_context_options.sdpo_teacher_context
    if a.alpha_sdpo > 0 and source == "hint" and not hint_fn and cols is not None and not cols & HINT_COLUMNS:
        raise ValueError(
            f"alpha_sdpo={a.alpha_sdpo} needs hints: a `hint` or `hinted_prompt` dataset column, or "
            "`hint_fn=`; provide one, set sdpo_teacher_context='success' (successful siblings teach, no hint "
            "needed) or set alpha_sdpo=0."
        )
    if (
        a.alpha_sdpo > 0
        and source in ("feedback", "success+feedback")
        and not hint_fn
        and cols is not None
        and "privileged_context" not in cols
    ):
        raise ValueError(
            f"sdpo_teacher_context={source!r} needs the environment's feedback: `hint_fn=` (its text per "
            "completion is the feedback) or a `privileged_context` dataset column; provide one or use "
            "sdpo_teacher_context='success'."
        )
    if a.beta_replay > 0 and cols is not None and a.replay_pairs == "on_policy":
        check_on_policy_columns(cols)
    elif a.beta_replay > 0 and cols is not None and not cols >= PAIR_COLUMNS:
        raise ValueError(
            f"beta_replay={a.beta_replay} needs `chosen` and `rejected` dataset columns (the teacher trace and "
            f"the trace it beats); the dataset has {sorted(cols)}. Add them or set beta_replay=0."
        )


def group_contexts(
    args: ComposerGRPOConfig,
    prompts: Sequence[Any],
    completions: Sequence[str],
    rewards: Sequence[float],
    group_size: int,
    feedback: Sequence[str | None] | None,
) -> TeacherContexts:
    """The teacher contexts ``ComposerGRPOTrainer`` builds for one generation batch (all processes' rows, in
    order), from its config's ``sdpo_teacher_context`` options (:func:`composer_core.sdpo.build_teacher_contexts`)."""
    return build_teacher_contexts(
        prompts,
        completions,
        rewards,
        group_size,
        args.teacher_context_options,
        feedback=feedback,
        seed=args.seed,
    )


class _SDPOTeacherCallback(TrainerCallback):
    """The ``ema``/``base`` teacher's life cycle: the EMA update after each ``teacher_sync_steps``-th optimiser step
    (:func:`composer_core.sdpo.ema_update_`, TRL's order of float ops) and its weights in every checkpoint
    (restored by :meth:`ComposerGRPOTrainer._load_from_checkpoint`)."""

    def __init__(self, trainer: ComposerGRPOTrainer) -> None:
        self.trainer = trainer

    def _teacher(self) -> torch.nn.Module:
        assert self.trainer._sdpo_teacher is not None
        teacher: torch.nn.Module = self.trainer.accelerator.unwrap_model(self.trainer._sdpo_teacher)
        return teacher

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        opts = self.trainer.args.teacher_weights_options
        if not opts.syncs_at(state.global_step):
            return control
        if self.trainer._sdpo_teacher is None:  # PEFT: the teacher adapter follows the student's adapter
            ema_update_tensors_(self.trainer._adapter_pairs().values(), opts.teacher_update_rate)
        else:
            student = self.trainer.accelerator.unwrap_model(self.trainer.model)
            ema_update_(self._teacher(), student, opts.teacher_update_rate)
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        run_dir = self.trainer._get_output_dir(trial=None)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(folder) or not self.trainer.accelerator.is_main_process:
            return control
        if self.trainer._sdpo_teacher is None:
            from safetensors.torch import save_file

            state_dict = {n: t.detach().contiguous() for n, (t, _) in self.trainer._adapter_pairs().items()}
            save_file(state_dict, os.path.join(folder, TEACHER_STATE_FILE))
        else:
            save_teacher(self._teacher(), folder)
        return control


class _MergedPairs:
    """The chosen/rejected rows of a micro-batch appended to the student's rows, for one forward.

    Rows: the B policy rows (prompt ⊕ completion), then P chosen and P rejected rows (prompt ⊕ action), all
    right-padded to one width W = max(T, pair width) with attention 0 after each row's end, so (causal
    attention) every real position sees exactly what it saw in separate forwards. ``policy`` slices the B
    policy rows' first T positions back out; ``pair_sums`` gives the pairs' summed log-probs, as
    ``ComposerGRPOTrainer._pair_logps`` computes them.
    """

    def __init__(self, inputs: dict[str, Any], t: int, pad_id: int, sides: int = 2) -> None:
        rows = inputs[f"{_K}has_pair"].nonzero().squeeze(-1)
        self.b, self.t, self.n, self.pad_id = inputs["completion_ids"].size(0), t, rows.numel(), pad_id
        self.prompt_ids, self.prompt_mask = inputs["prompt_ids"][rows], inputs["prompt_mask"][rows]
        self.sides = sides  # 1: on-policy pairs, the chosen rows only (the rejected side is a policy row)
        names = ("chosen", "rejected")[:sides]
        self.pair_ids = torch.cat([inputs[f"{_K}{s}_ids"][rows] for s in names])
        self.pair_attn = torch.cat([inputs[f"{_K}{s}_attn"][rows] for s in names])
        self.pair_mask = torch.cat([inputs[f"{_K}{s}_mask"][rows] for s in names])
        self.width = max(t, self.pair_ids.size(1))

    @staticmethod
    def _pad(x: Tensor, extra: int, fill: int) -> Tensor:
        return x if extra == 0 else torch.cat([x, x.new_full((x.size(0), extra), fill)], dim=1)

    def _rows(self, policy: Tensor, prompt: Tensor, pair: Tensor, fill: int) -> Tensor:
        pairs = torch.cat(
            [torch.cat([prompt] * self.sides), self._pad(pair, self.width - pair.size(1), fill)], 1
        )
        return torch.cat([self._pad(policy, self.width - self.t, fill), pairs])

    def input_ids(self, policy_ids: Tensor) -> Tensor:
        """[B + 2P, prompt + W]: policy rows (prompt ⊕ completion) then chosen and rejected rows."""
        return self._rows(policy_ids, self.prompt_ids, self.pair_ids, self.pad_id)

    def attention(self, policy_mask: Tensor) -> Tensor:
        return self._rows(policy_mask, self.prompt_mask, self.pair_attn, 0)

    def policy(self, x: Tensor | None) -> Tensor:
        assert x is not None
        return x[: self.b, : self.t]

    def policy_hidden(self, hidden: Tensor) -> Tensor:
        """Hidden states [B, P + T, H] of the policy rows (what a forward of those rows alone returns)."""
        end = hidden.size(1) - (self.width - self.t)
        return hidden[: self.b, :end]

    def pair_sums(self, logps: Tensor) -> tuple[Tensor, Tensor]:
        pair = logps[self.b :, : self.pair_ids.size(1)]
        summed = (pair * self.pair_mask).sum(-1)
        return summed[: self.n], summed[self.n :]


class _HiddenCapture:
    """Context manager keeping the backbone's ``last_hidden_state`` of the next forward (with its graph)."""

    def __init__(self, base: Any) -> None:
        self.module = base.base_model
        self.hidden: Tensor | None = None
        self._handle: Any = None

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        if self.hidden is None:  # the first call only (gradient checkpointing re-runs the forward)
            self.hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def __enter__(self) -> _HiddenCapture:
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()
        if exc[0] is None and self.hidden is None:
            raise RuntimeError(
                "composer could not capture the backbone's hidden states from TRL's fused-head forward "
                "(unexpected model structure); use sdpo_form='sampled'."
            )


def _finite(row: dict[str, Any], key: str) -> float:
    value = _get(row, key)
    if value is None or not isinstance(value, int | float) or value != value or abs(value) == float("inf"):
        raise ValueError(
            f"`{key}` must be a finite float (summed reference log-prob) in every pair row, got {value!r}."
        )
    return float(value)
