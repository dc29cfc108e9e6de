"""Producers of channels 2 and 3 inside verl's own loop (``trainer.v1.trainer_mode=composer_sync``).

After rollout and reward, before verl balances the batch and computes ``old_log_probs``, :class:`ComposerProducers`
adds channel 2's teacher log-probs (``composer_teacher_log_probs``, ``composer_sdpo_mask``) and appends channel 3's
pair rows (``composer_pref_pair_id`` / ``composer_pref_chosen``); the README's "Producers" section says how.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from composer_core.traces.hints import HintJob, load_hint_fn

from composer_verl.batch import (
    PREF_CHOSEN,
    PREF_PAIR_ID,
    SDPO_MASK,
    TEACHER_LOG_PROBS,
    TEACHER_METHOD,
    TEACHER_PROMPTS,
)
from composer_verl.config import ComposerVerlConfig, HintFn, configure, section_of
from composer_verl.envs import env_hint_fn
from composer_verl.rows import (
    GroupContexts,
    RecordPairs,
    as_messages,
    context_prompt_ids,
    dataset_pairs,
    group_teacher_contexts,
    hinted_prompt_ids,
    on_policy_pair_rows,
    pair_sample,
    pairs_last,
    render_prompt_ids,
    response_ids,
    reward_extra,
    with_prompt,
)


def check_settings(config: ComposerVerlConfig, actor: Mapping[str, Any]) -> None:
    """Refuse an actor config that could split a preference pair over two micro-batches."""
    if config.pair_source is None:
        return
    if actor.get("shuffle") or actor.get("use_dynamic_bsz"):
        raise ValueError(
            "composer.pair_source needs actor_rollout_ref.actor.shuffle=false and use_dynamic_bsz=false "
            "(both rows of a pair must stay in one micro-batch)."
        )
    micro = actor.get("ppo_micro_batch_size_per_gpu")
    if micro is None or int(micro) % 2:
        raise ValueError(
            f"composer.pair_source needs an even actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, got {micro}."
        )


# --- the trainer-side glue (TransferQueue, the actor worker group) ---------------------------------------------


def _infer_micro_batch(config: Any) -> int:
    """Rows per micro-batch of the actor's ``compute_log_prob`` (1 with dynamic batch size: no constraint)."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.get("log_prob_use_dynamic_bsz", False):
        return 1
    return int(rollout.get("log_prob_micro_batch_size_per_gpu", None) or 1)


def _nested(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def _tags(tag0: dict[str, Any], rows: Sequence[Mapping[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    """verl's per-row tags for new rows: a copy of ``tag0`` with each row's lengths (and ``extra``)."""
    tags = []
    for r in rows:
        tag = copy.deepcopy(tag0)
        prompt_len, response_len = int(r["prompts"].numel()), int(r["responses"].numel())
        tag.update(extra, prompt_len=prompt_len, response_len=response_len, seq_len=prompt_len + response_len)
        tags.append(tag)
    return tags


class ComposerProducers:
    """Runs the producers of the ``composer:`` section on one step's ``KVBatchMeta`` (driver side, inside
    ``ComposerPPOTrainerSync``); ``sdpo_form``: ``sampled`` (the teacher log-probs are computed here) or ``topk``
    (inside the actor's training forward)."""

    def __init__(self, config: ComposerVerlConfig, tokenizer: Any, response_length: int) -> None:
        self.config = config
        self.teacher = config.teacher.sdpo_teacher
        self.form = config.sdpo_form
        self.tokenizer = tokenizer
        self.response_length = response_length
        self.hint_fn: HintFn | None = env_hint_fn(config.env) if config.env is not None else None
        if config.hint_fn:  # the section refuses both
            self.hint_fn = load_hint_fn(config.hint_fn, option="composer.hint_fn")
        self.records: RecordPairs | None = None
        if config.pair_source not in (None, "dataset"):
            self.records = RecordPairs(config.pair_source, config.pairs_per_step)
        self.pair_keys: list[tuple[str, str]] = []

    @classmethod
    def from_trainer_config(cls, config: Any, tokenizer: Any) -> ComposerProducers | None:
        """Read the ``composer:`` section once (this process's config from then on) and build the producers
        it asks for (None: it asks for none)."""
        from omegaconf import OmegaConf

        composer = configure(section_of(config))
        assert composer is not None
        if not (composer.hints or composer.pair_source is not None):
            return None
        check_settings(composer, OmegaConf.to_container(config.actor_rollout_ref.actor, resolve=True))  # type: ignore[arg-type]
        return cls(composer, tokenizer, int(config.data.max_response_length))

    # -- before verl balances the batch: append pairs, compute hints and teacher log-probs ---------------------

    def before_balance(self, trainer: Any, batch: Any, metrics: dict[str, float]) -> Any:
        import transfer_queue as tq
        from verl.utils import tensordict_utils as tu

        batch = self._append_pairs(batch, self._samples(batch), metrics)
        samples = self._samples(batch)
        pair_of = {k: (j, int(side == 0)) for j, p in enumerate(self.pair_keys) for side, k in enumerate(p)}
        pair_rows = {
            i: pair_of[k] for i, k in enumerate(batch.keys) if k in pair_of
        }  # row -> (pair id, chosen)

        # demo_pick=random is seeded by verl's global step: reproducible, one draw per step and group
        seed = int(getattr(trainer, "global_steps", 0) or 0)
        teacher_prompts = self._teacher_prompts(samples, pair_rows, metrics, seed=seed)
        metrics["composer/sdpo/hinted_rows"] = float(len(teacher_prompts))
        # with sdpo_form='topk' the actor scores the teacher contexts inside its training forward (actor.py)
        teacher_rows = {} if self.form == "topk" else teacher_prompts
        teacher_in = [with_prompt(samples[i], ids) for i, ids in teacher_rows.items()]
        # the pair rows' behaviour log-probs: the actor's own (they were not sampled)
        pair_in = [with_prompt(samples[i], samples[i]["prompts"].tolist()) for i in pair_rows]
        if self.teacher == "live":  # one actor pass: teacher contexts + pair rows
            scored = self._actor_log_probs(trainer, batch, teacher_in + pair_in)
        else:  # the teacher's own weights (ema/base, held by the actor worker) score the teacher contexts
            scored = self._actor_log_probs(trainer, batch, teacher_in, TEACHER_METHOD)
            scored += self._actor_log_probs(trainer, batch, pair_in)
        teacher_lp = dict(zip(teacher_rows, scored, strict=False))
        rollout_lp = dict(zip(pair_rows, scored[len(teacher_rows) :], strict=True))

        def per_row(values: Mapping[int, torch.Tensor]) -> torch.Tensor:
            zeros = [torch.zeros(s["responses"].numel()) for s in samples]
            return _nested([values[i].to(torch.float32) if i in values else z for i, z in enumerate(zeros)])

        fields = {
            TEACHER_LOG_PROBS: per_row(teacher_lp),
            SDPO_MASK: per_row({i: samples[i]["response_mask"] for i in teacher_prompts}),
            PREF_PAIR_ID: torch.tensor([pair_rows.get(i, (-1, 0))[0] for i in range(len(samples))]),
            PREF_CHOSEN: torch.tensor([pair_rows.get(i, (-1, 0))[1] for i in range(len(samples))]),
        }
        if self.form == "topk":  # a row without a teacher context keeps its own prompt (its SDPO mask is 0)
            ids = {i: torch.tensor(p) for i, p in teacher_prompts.items()}
            prompts = [ids.get(i, s["prompts"]).long() for i, s in enumerate(samples)]
            fields[TEACHER_PROMPTS] = _nested(prompts)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=tu.get_tensordict(fields))
        if rollout_lp:
            tq.kv_batch_put(
                keys=[batch.keys[i] for i in rollout_lp],
                partition_id=batch.partition_id,
                fields=tu.get_tensordict(
                    {"rollout_log_probs": _nested([lp.float() for lp in rollout_lp.values()])}
                ),
            )
        return batch

    # -- after verl balanced (and padded) the batch: fix padding rows, keep pairs together ---------------------

    def after_balance(self, batch: Any) -> Any:
        import transfer_queue as tq
        from verl.utils import tensordict_utils as tu

        own = {k for p in self.pair_keys for k in p}
        padding = [i for i, t in enumerate(batch.tags) if t.get("is_padding") and batch.keys[i] not in own]
        if padding:  # verl's padding rows copy row 0's fields: give them empty composer fields
            keys = [batch.keys[i] for i in padding]
            data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["responses"])
            resp = data["responses"]  # jagged, or dense when every padding row has the same length
            lens = resp.offsets().diff().tolist() if resp.is_nested else [resp.shape[-1]] * resp.shape[0]
            zeros = [torch.zeros(int(n_), dtype=torch.float32) for n_ in lens]
            fields = {
                TEACHER_LOG_PROBS: _nested(zeros),
                SDPO_MASK: _nested([z.clone() for z in zeros]),
                PREF_PAIR_ID: torch.full((len(keys),), -1, dtype=torch.int64),
                PREF_CHOSEN: torch.zeros(len(keys), dtype=torch.int64),
            }
            tq.kv_batch_put(keys=keys, partition_id=batch.partition_id, fields=tu.get_tensordict(fields))
        if self.pair_keys:
            order = pairs_last(batch.keys, self.pair_keys)
            batch.reorder(order)
            first = len(batch.keys) - 2 * len(self.pair_keys)
            if first % 2:
                raise ValueError(
                    f"composer pairs start at odd row {first}: make the batch size (train_batch_size x rollout.n) even."
                )
        return batch

    # -- helpers ----------------------------------------------------------------------------------------------

    @staticmethod
    def _samples(batch: Any) -> list[dict[str, Any]]:
        import transfer_queue as tq

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id)
        rows = [data[i] for i in range(len(batch.keys))]
        return [{k: row[k] for k in row.keys()} for row in rows]  # noqa: SIM118 (TensorDict rows)

    def _teacher_prompts(
        self,
        samples: Sequence[Mapping[str, Any]],
        skip: Collection[int],
        metrics: dict[str, float],
        seed: int = 0,
    ) -> dict[int, list[int]]:
        """Teacher prompt ids of every distilled row (by index); rows absent from the answer get SDPO mask 0."""
        opts = self.config.context
        if not opts.from_group:
            return {
                job.index: hinted_prompt_ids(
                    self.tokenizer, samples[job.index]["raw_prompt"], job.hint, self.config.hint_role
                )
                for job in self._hint_jobs(samples, skip)
            }
        built = self._group_contexts(samples, skip, seed)
        for key, value in built.metrics.items():
            metrics[f"composer/sdpo/{key}"] = float(value)
        return {
            i: context_prompt_ids(self.tokenizer, ctx, opts.max_reprompt_len)
            for i, ctx in built.contexts.items()
        }

    def _group_contexts(
        self, samples: Sequence[Mapping[str, Any]], skip: Collection[int], seed: int = 0
    ) -> GroupContexts:
        """The SDPO paper's teacher contexts from each ``uid`` group (successful siblings and/or feedback)."""
        opts, n = self.config.context, len(samples)
        rows = [i for i in range(n) if i not in skip]
        if any("rm_scores" not in samples[i] or "uid" not in samples[i] for i in rows):
            raise ValueError(
                f"composer.sdpo_teacher_context={opts.sdpo_teacher_context} needs each row's reward (rm_scores) "
                "and group id (uid): run it in verl's v1 loop (trainer.v1.trainer_mode=composer_sync) with a "
                "reward function."
            )
        feedback: list[str | None] | None = None
        if opts.uses_feedback:
            feedback = [None] * n
            for job in self._hint_jobs(samples, skip):
                feedback[job.index] = job.hint
        prompts: list[Any] = [None] * n
        uids, completions, rewards = [""] * n, [""] * n, [0.0] * n
        for i in rows:
            _, completions[i], rewards[i], _ = self._hint_args(samples[i])
            uids[i] = str(samples[i]["uid"])
            raw = samples[i]["raw_prompt"]  # text stays text, messages become a list of dicts
            prompts[i] = raw if isinstance(raw, str) else as_messages(raw)
        return group_teacher_contexts(rows, uids, prompts, completions, rewards, opts, feedback, seed)

    def _hint_jobs(self, samples: Sequence[Mapping[str, Any]], skip: Collection[int]) -> list[HintJob[int]]:
        """Rows (by index) that ``hint_fn`` gave a hint; pair rows (``skip``) are not asked."""
        from composer_core.traces.hints import hint_jobs

        if self.hint_fn is None:
            return []
        hint_fn = self.hint_fn
        return hint_jobs(
            range(len(samples)),
            lambda i: hint_fn(*self._hint_args(samples[i])),
            option="composer.hint_fn",
            skip=skip,
        )

    def _hint_args(self, s: Mapping[str, Any]) -> tuple[str, str, float, dict[str, Any]]:
        """``hint_fn``'s inputs for one row: decoded prompt and response, Σ rm_scores, the reward's extra info."""
        prompt = self.tokenizer.decode(s["prompts"].tolist(), skip_special_tokens=True)
        resp = s["responses"][s["response_mask"].bool()] if "response_mask" in s else s["responses"]
        response = self.tokenizer.decode(resp.tolist(), skip_special_tokens=True)
        reward = float(s["rm_scores"].sum()) if "rm_scores" in s else 0.0
        return prompt, response, reward, reward_extra(s)

    def _append_pairs(
        self, batch: Any, samples: Sequence[Mapping[str, Any]], metrics: dict[str, float]
    ) -> Any:
        import transfer_queue as tq
        from transfer_queue import KVBatchMeta
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        self.pair_keys = []
        if self.config.pair_source is None:
            return batch
        pairs = self._pair_rows(samples)
        rows, keys, tags = [], [], []
        for pair in pairs:
            for side, row in zip(("chosen", "rejected"), pair, strict=True):
                rows.append(row)
                keys.append(f"{row['uid']}_{side}_0")
                tags += _tags(batch.tags[0], [row], is_padding=True, composer_pair=side)
            self.pair_keys.append((keys[-2], keys[-1]))
        metrics["composer/replay/appended_pairs"] = float(len(pairs))
        if not rows:
            return batch
        tq.kv_batch_put(
            keys=keys, partition_id=batch.partition_id, fields=list_of_dict_to_tensordict(rows), tags=tags
        )
        return KVBatchMeta(
            keys=batch.keys + keys,
            tags=batch.tags + tags,
            partition_id=batch.partition_id,
            fields=batch.fields,
            extra_info=batch.extra_info,
        )

    def _pair_rows(self, samples: Sequence[Mapping[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """This step's pairs as (chosen, rejected) rows built on real samples."""
        if self.config.replay_pairs == "on_policy":
            threshold = self.config.success_reward_threshold
            return on_policy_pair_rows(samples, threshold, self.tokenizer, self.response_length)
        out = []
        for p in self.records.take() if self.records is not None else dataset_pairs(samples):
            prompt_ids = render_prompt_ids(self.tokenizer, p.prompt)
            c, r = (response_ids(self.tokenizer, t, self.response_length) for t in (p.chosen, p.rejected))
            out.append((pair_sample(samples[0], prompt_ids, c), pair_sample(samples[0], prompt_ids, r)))
        return out

    def _actor_log_probs(
        self, trainer: Any, batch: Any, rows: Sequence[Mapping[str, Any]], method: str = "compute_log_prob"
    ) -> list[torch.Tensor]:
        """Per-response-token log-probs of ``rows`` under the current actor (verl's ``compute_log_prob``) or, with
        ``method=TEACHER_METHOD``, under the SDPO teacher's weights the actor worker holds."""
        import transfer_queue as tq
        from transfer_queue import KVBatchMeta
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict
        from verl.workers.utils.padding import response_from_nested

        if not rows:
            return []
        wg = trainer.actor_rollout_wg
        if "actor" not in wg._dispatch_info:
            wg._dispatch_info["actor"] = wg._query_dispatch_info("actor")
        dp = max(wg._dispatch_info["actor"]) + 1
        n_real = len(rows)
        # the worker group splits evenly over dp ranks, and each rank's engine (without dynamic batch size) splits
        # its share into micro-batches of rollout.log_prob_micro_batch_size_per_gpu rows: pad with copies of row 0
        rows = list(rows) + [rows[0]] * ((-n_real) % (dp * _infer_micro_batch(trainer.config)))
        stem = f"composer-score-{uuid.uuid4().hex}"
        keys = [f"{stem}_{i}_0" for i in range(len(rows))]
        tags = _tags(batch.tags[0], rows)
        tq.kv_batch_put(
            keys=keys, partition_id=batch.partition_id, fields=list_of_dict_to_tensordict(rows), tags=tags
        )
        temperature = trainer.config.actor_rollout_ref.rollout.temperature
        extra = {
            **batch.extra_info,
            "calculate_entropy": False,
            "compute_loss": False,
            "temperature": temperature,
        }
        try:
            meta = KVBatchMeta(
                keys=keys, tags=tags, partition_id=batch.partition_id, fields=batch.fields, extra_info=extra
            )
            getattr(wg, method)(meta)
            data = tq.kv_batch_get(
                keys=keys, partition_id=batch.partition_id, select_fields=["log_probs", "response_mask"]
            )
            lp = response_from_nested(data["log_probs"], data["response_mask"])
            return [lp[i] for i in range(n_real)]
        finally:
            tq.kv_clear(keys=keys, partition_id=batch.partition_id)
