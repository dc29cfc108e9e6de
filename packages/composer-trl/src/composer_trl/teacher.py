"""Channel 2's teacher in ``ComposerGRPOTrainer``: its context (a hint, or the group's successes and feedback,
tokenised and left-padded per row), its weights (``sdpo_teacher`` live / base / ema, saved with every checkpoint)
and its forward (the hinted context read without gradient; the student's hidden states captured from its own
forward, so the fused LM-head loss never materialises [B, T, V]).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from accelerate.utils import gather_object, is_peft_model
from composer_core.loss.compose import ComposerBatch
from composer_core.loss.metrics import ADAPTER_PREFIX
from composer_core.sdpo import (
    TEACHER_STATE_FILE,
    TeacherContextOptions,
    TeacherContexts,
    TeacherWeightsOptions,
    build_teacher_contexts,
    cap_reprompt,
    ema_update_,
    ema_update_tensors_,
    frozen_copy,
    load_teacher,
    save_teacher,
)
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl.data_utils import is_conversational
from trl.trainer.utils import pad, use_adapter

from composer_trl.metrics import ComposerMetrics

HintFn = Callable[..., Sequence[str | None]]
logger = logging.get_logger(__name__)

K = "composer_"  # prefix of the extra keys carried from generation to the loss
TEACHER_ADAPTER = "composer_sdpo_teacher"
"""The PEFT adapter that holds the ``sdpo_teacher='ema'`` teacher of a PEFT student."""

ALIASES = {
    "hinted_prompt": "teacher_prompt",
    "ref_chosen_logps": "ref_chosen_logp",
    "ref_rejected_logps": "ref_rejected_logp",
}
""":mod:`composer_core.traces.records` (trace-record) column names accepted for the trainer's own."""


def column(row: dict[str, Any], key: str) -> Any:
    """``row[key]``, or its trace-record alias (:data:`ALIASES`) when absent."""
    value = row.get(key)
    return row.get(ALIASES[key]) if value is None and key in ALIASES else value


def base_model(model: Any) -> Any:
    """The model whose backbone and LM head run (DDP / accelerate wrappers and PEFT unwrapped)."""
    while hasattr(model, "module") and not hasattr(model, "get_output_embeddings"):
        model = model.module
    return model.get_base_model() if is_peft_model(model) else model  # LoRA layers are injected in place


class SDPOTeacher(ComposerMetrics):
    """The channel-2 layer of :class:`~composer_trl.ComposerGRPOTrainer` (module docstring)."""

    hint_fn: HintFn | None
    teacher_context: TeacherContextOptions  # built once, at construction
    teacher_weights: TeacherWeightsOptions
    _sdpo_teacher: torch.nn.Module | None  # the ema/base teacher's own weights (None: live, or PEFT)
    _no_success_warned: bool
    _last_rewards_per_func: Tensor | None

    def _setup_sdpo(self) -> None:
        """``sdpo_teacher``: live (the student), base (a frozen copy; PEFT: adapters off) or ema (a copy updated
        by :class:`_SDPOTeacherCallback`). The copy is saved with every checkpoint and restored on resume."""
        self.teacher_context = self.args.teacher_context_options
        self.teacher_weights = self.args.teacher_weights_options
        self._sdpo_teacher, self._no_success_warned, self._last_rewards_per_func = None, False, None
        kind = self.teacher_weights.sdpo_teacher
        if self.compose_config.alpha_sdpo == 0:
            return
        self._check_head()
        if kind == "live" or (kind == "base" and is_peft_model(self.model)):
            return
        if is_peft_model(self.model):
            self._add_teacher_adapter()
        else:
            teacher = frozen_copy(self.accelerator.unwrap_model(self.model))
            self._sdpo_teacher = self.accelerator.prepare_model(teacher, evaluation_mode=True)
        self.add_callback(_SDPOTeacherCallback(self))

    def _check_head(self) -> None:
        form = self.args.sdpo_form
        if form == "sampled":
            return
        base = base_model(self.model)
        head = base.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear):
            raise ValueError(
                f"sdpo_form={form!r} reads the LM-head weight directly, but the output embedding is a "
                f"{type(head).__name__} (e.g. LoRA on lm_head); exclude lm_head from the adapter or use "
                "sdpo_form='sampled'."
            )
        text_cfg = base.config.get_text_config()
        for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier", "logits_scaling"):
            value = getattr(text_cfg, attr, None)
            if value not in (None, 1.0):
                raise ValueError(
                    f"sdpo_form={form!r} projects hidden states with the plain LM head, but this model's config "
                    f"sets {attr}={value!r}; use sdpo_form='sampled' for it."
                )

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
        active, tag = f".{peft_model.active_adapter}.", f".{TEACHER_ADAPTER}."
        params = dict(peft_model.named_parameters())
        pairs: dict[str, tuple[Tensor, Tensor]] = {}
        for name, p in params.items():
            student = params.get(name.replace(tag, active)) if tag in name else None
            if student is not None:
                pairs[name] = (p, student)
        return pairs

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self._sdpo_teacher is not None:
            load_teacher(self.accelerator.unwrap_model(self._sdpo_teacher), resume_from_checkpoint)
        elif (
            self.teacher_weights.sdpo_teacher == "ema" and self.compose_config.alpha_sdpo > 0
        ):  # PEFT adapter
            path = os.path.join(resume_from_checkpoint, TEACHER_STATE_FILE)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} is missing: the checkpoint holds no EMA teacher adapter.")
            state = load_file(path)
            with torch.no_grad():
                for name, (teacher, _) in self._adapter_pairs().items():
                    teacher.copy_(state[name])

    # ------------------------------------------------------------------ generation: the teacher contexts

    def _build_hints(self, inputs: list[dict[str, Any]], output: dict[str, Any]) -> dict[str, Any]:
        if self.hint_fn is not None:
            hints = self._call_hint_fn(inputs, output, "hints")
            hinted = [None if h is None else self._apply_hint(x["prompt"], h) for x, h in zip(inputs, hints)]
        else:
            hinted = [
                column(x, "hinted_prompt") if column(x, "hinted_prompt") is not None
                else None if x.get("hint") is None else self._apply_hint(x["prompt"], x["hint"])
                for x in inputs
            ]  # fmt: skip
        for h in hinted:
            if h is not None and not isinstance(h, str | list):
                raise ValueError(f"a hint must be a string (or a chat message list), got {type(h).__name__}.")
        return self._teacher_tensors(hinted, output)

    def _teacher_tensors(self, contexts: list[Any | None], output: dict[str, Any]) -> dict[str, Any]:
        """The teacher prompts (None: not distilled) tokenised, left-padded, capped at ``max_reprompt_len``."""
        device, pad_id = self.accelerator.device, self._tokenizer.pad_token_id
        has_hint = torch.tensor([h is not None for h in contexts], device=device)
        rows = [i for i, h in enumerate(contexts) if h is not None]
        ids_list = [torch.full((1,), pad_id)] * len(contexts)
        mask_list = [torch.zeros(1, dtype=torch.long)] * len(contexts)
        if rows:
            tok_ids, _, _ = self._tokenize_prompts([contexts[i] for i in rows])
            for i, ids in zip(rows, tok_ids):
                ids = cap_reprompt(ids, self.teacher_context.max_reprompt_len)
                ids_list[i], mask_list[i] = torch.tensor(ids), torch.ones(len(ids), dtype=torch.long)
        loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
        # seq_mean: normalised by rows, distilled or not (TRL SDPOTrainer)
        if self.compose_config.sdpo.loss_agg == "seq_mean":
            local = torch.tensor(float(len(contexts)), device=device)
        else:
            local = (loss_mask * has_hint.unsqueeze(1)).sum()
        return {
            f"{K}hint_ids": pad(ids_list, padding_value=pad_id, padding_side="left").to(device),
            f"{K}hint_mask": pad(mask_list, padding_value=0, padding_side="left").to(device),
            f"{K}has_hint": has_hint,
            f"{K}sdpo_num_items": self.accelerator.gather(local).sum(),
        }

    def _group_rewards(self) -> list[float]:
        """The weighted reward of every completion of the generation batch (all processes; NaN: unscorable)."""
        rpf = self._last_rewards_per_func
        assert rpf is not None, "GRPOTrainer computed no rewards before the teacher contexts"
        rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rpf).all(dim=1)] = torch.nan
        return [float(r) for r in rewards.tolist()]

    def _group_size(self, mode: str) -> int:
        size = self.num_generations if mode == "train" else self.num_generations_eval
        assert size is not None  # GRPOTrainer sets both
        return int(size)

    def _call_hint_fn(self, inputs: list[dict[str, Any]], output: dict[str, Any], what: str) -> list[Any]:
        """``hint_fn(prompts=, completions=, completion_ids=, **columns)``: one value per completion."""
        assert self.hint_fn is not None
        columns = {k: [x.get(k) for x in inputs] for k in inputs[0] if k not in ("prompt", "completion")}
        ids, mask = output["completion_ids"], output["completion_mask"]
        texts = self._tokenizer.batch_decode(
            [r[m.bool()].tolist() for r, m in zip(ids, mask)], skip_special_tokens=True
        )
        prompts = [x["prompt"] for x in inputs]
        values = list(self.hint_fn(prompts=prompts, completions=texts, completion_ids=ids, **columns))
        if len(values) != len(inputs):
            raise ValueError(f"hint_fn returned {len(values)} {what} for {len(inputs)} completions.")
        return values

    def _build_group_contexts(
        self, inputs: list[dict[str, Any]], output: dict[str, Any], mode: str
    ) -> dict[str, Any]:
        """Teacher contexts from the group's successful siblings and/or feedback (``composer_core.sdpo``), built
        over the whole generation batch (every process) so a group split across processes sees all its rows.
        Feedback: ``hint_fn``'s text per completion, else the ``privileged_context`` column."""
        opts = self.teacher_context
        feedback = None
        if opts.uses_feedback:
            feedback = gather_object(
                [x.get("privileged_context") for x in inputs]
                if self.hint_fn is None
                else self._call_hint_fn(inputs, output, "feedback texts")
            )
        pad_id = self._tokenizer.pad_token_id
        demos = self._tokenizer.batch_decode(
            [row[row != pad_id].tolist() for row in output["completion_ids"]], skip_special_tokens=True
        )
        prompts, demos = gather_object([x["prompt"] for x in inputs]), gather_object(demos)
        rewards, size = self._group_rewards(), self._group_size(mode)
        ctx = build_teacher_contexts(
            prompts, demos, rewards, size, opts, feedback=feedback, seed=self.args.seed
        )
        self._log_contexts(mode, ctx)
        start = self.accelerator.process_index * len(inputs)
        return self._teacher_tensors(ctx.contexts[start : start + len(inputs)], output)

    def _log_contexts(self, mode: str, ctx: TeacherContexts) -> None:
        for key, value in ctx.metrics.items():
            self._metrics[mode][f"{ADAPTER_PREFIX}sdpo/{key}"].append(value)
        a = self.teacher_context
        if a.uses_success and ctx.groups_with_success == 0 and not self._no_success_warned:
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
        if not is_conversational({"prompt": prompt}):
            return self.args.hint_template.format(hint=hint, prompt=prompt)
        messages = [dict(m) for m in prompt]
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            raise ValueError("a chat prompt needs a user message to attach the hint to.")
        messages[last_user]["content"] = f"{messages[last_user]['content']}\n\n{hint}"
        return messages

    # ------------------------------------------------------------------ the loss: the teacher's forward

    def _fill_sdpo(
        self,
        batch: ComposerBatch,
        model: Any,
        inputs: dict[str, Any],
        mask: Tensor,
        capture: HiddenCapture | None,
        logits_to_keep: int,
    ) -> None:
        has_hint = inputs[f"{K}has_hint"]
        rows = has_hint.nonzero().squeeze(-1)
        t_ids = torch.cat([inputs[f"{K}hint_ids"][rows], inputs["completion_ids"][rows]], dim=1)
        t_mask = torch.cat([inputs[f"{K}hint_mask"][rows], inputs["completion_mask"][rows]], dim=1)
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
        base, t_base = base_model(model), base_model(teacher_model)
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
        batch.student_hidden, batch.teacher_hidden = student_hidden, teacher_hidden
        batch.lm_head_weight, batch.lm_head_bias = head.weight, head.bias
        if t_base is not base:
            batch.teacher_lm_head_weight, batch.teacher_lm_head_bias = t_head.weight, t_head.bias

    def _teacher_weights(self) -> AbstractContextManager[Any]:
        """PEFT: the ``base`` teacher reads the base weights (adapters off), the ``ema`` teacher its own adapter;
        other teachers need nothing."""
        kind = self.teacher_weights.sdpo_teacher
        if is_peft_model(self.model) and kind != "live":
            name = None if kind == "base" else TEACHER_ADAPTER
            return use_adapter(self.accelerator.unwrap_model(self.model), adapter_name=name)
        return nullcontext()


class HiddenCapture:
    """Context manager keeping the backbone's ``last_hidden_state`` of the next forward (with its graph)."""

    def __init__(self, base: Any) -> None:
        self.module = base.base_model
        self.hidden: Tensor | None = None
        self._handle: Any = None

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        if self.hidden is None:  # the first call only (gradient checkpointing re-runs the forward)
            self.hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def __enter__(self) -> HiddenCapture:
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()
        if exc[0] is None and self.hidden is None:
            raise RuntimeError(
                "composer could not capture the backbone's hidden states from TRL's fused-head forward "
                "(unexpected model structure); use sdpo_form='sampled'."
            )


class _SDPOTeacherCallback(TrainerCallback):
    """The ``ema``/``base`` teacher's life cycle: the EMA update after each ``teacher_sync_steps``-th optimiser step
    (:func:`composer_core.sdpo.ema_update_`, TRL's order of float ops) and its weights in every checkpoint
    (restored by ``SDPOTeacher._load_from_checkpoint``)."""

    def __init__(self, trainer: SDPOTeacher) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        t, opts = self.trainer, self.trainer.teacher_weights
        if not opts.syncs_at(state.global_step):
            return control
        if t._sdpo_teacher is None:  # PEFT: the teacher adapter follows the student's adapter
            ema_update_tensors_(t._adapter_pairs().values(), opts.teacher_update_rate)
        else:
            unwrap = t.accelerator.unwrap_model
            ema_update_(unwrap(t._sdpo_teacher), unwrap(t.model), opts.teacher_update_rate)
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        t = self.trainer
        folder = os.path.join(t._get_output_dir(trial=None), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(folder) or not t.accelerator.is_main_process:
            return control
        if t._sdpo_teacher is None:
            state_dict = {n: p.detach().contiguous() for n, (p, _) in t._adapter_pairs().items()}
            save_file(state_dict, os.path.join(folder, TEACHER_STATE_FILE))
        else:
            save_teacher(t.accelerator.unwrap_model(t._sdpo_teacher), folder)
        return control
