"""Producers of channels 2 and 3 inside verl's own loop (``trainer.v1.trainer_mode=composer_sync``).

Users write a hint function, not a pipeline stage. After rollout and reward (before verl balances the batch and
computes ``old_log_probs``), :class:`ComposerProducers` does, every step:

* **channel 2**: each row's teacher context (``hint_fn(prompt, response, reward, extra)``'s text as one
  ``hint_role`` message after the prompt, or the group-built reprompt of composer_core's
  :func:`~composer_core.sdpo.build_teacher_contexts`) is rendered with the chat template, and the actor (or the
  ema/base teacher it holds) re-scores the sampled response on it: ``composer_teacher_log_probs``, with
  ``composer_sdpo_mask`` 1 on the response tokens of those rows.
* **channel 3**: pairs from ``pair_source`` (the rows' ``chosen``/``rejected`` columns, or a
  ``composer_core.traces.records`` file; with ``replay_pairs=on_policy`` each failed response of the step, reward
  below ``success_reward_threshold``, against its row's ``chosen`` column) are appended as two rows each, with ``composer_pref_pair_id`` /
  ``composer_pref_chosen``, reward 0 and the actor's own ``rollout_log_probs``, tagged ``is_padding`` so verl's
  metrics skip them; after verl's balancing they move to the end of the batch, each pair in one micro-batch.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from composer_core.sdpo import TeacherContextOptions, build_teacher_contexts
from composer_core.traces.hints import HintJob
from composer_core.traces.onpolicy import ReplayPairOptions, ReplayPairs, check_on_policy_columns, failed_rows

from composer_verl.batch import (
    PREF_CHOSEN,
    PREF_PAIR_ID,
    SDPO_MASK,
    TEACHER_LOG_PROBS,
    TEACHER_METHOD,
    TEACHER_PROMPTS,
)

HintFn = Callable[[str, str, float, Mapping[str, Any]], "str | None"]
#: the ``composer:`` keys composer_core's TeacherContextOptions owns (ProducerConfig inherits them)
CONTEXT_KEYS: tuple[str, ...] = tuple(f.name for f in fields(TeacherContextOptions))


@dataclass(frozen=True)
class ProducerConfig(TeacherContextOptions):
    """The ``composer:`` section of verl's config (read by the driver; Hydra: ``composer.hint_fn=...``).

    hint_fn: import path ``package.module:function`` (or ``package.module.function``) of ``hint_fn(prompt: str,
        response: str, reward: float, extra: Mapping) -> str | None`` (None: no hint for that row; with
        ``sdpo_teacher_context`` ``feedback``/``success+feedback`` its text is the row's feedback).
    env: an environment spec (``composer_core.envs.load_env``) whose feedback on each sampled response is the hint
        (:func:`composer_verl.envs.env_hint_fn`); replaces ``hint_fn``.
    hint_role: role of the inserted hint message (``user`` or ``system``; ``sdpo_teacher_context='hint'`` only).
    pair_source: ``dataset`` (columns ``chosen``/``rejected`` of the training data) or the path of a
        ``composer_core.traces.records`` file; needs ``beta_replay > 0``.
    pairs_per_step: records per step when ``pair_source`` is a records file.
    replay_pairs: ``columns`` (default: both sides from ``pair_source``) or ``on_policy`` (needs
        ``pair_source=dataset``): every response of the step whose reward (Σ ``rm_scores``) is below
        ``success_reward_threshold`` is the rejected side of one pair, its row's ``chosen`` column the chosen side
        (a teacher's answer: a composer-replay record's, a teacher column or the reference); no ``rejected``
        column. The rejected row is a copy of the response (verl scores each pair in one micro-batch).

    The other keys are composer_core's :class:`~composer_core.sdpo.TeacherContextOptions` (inherited: same names,
    defaults and checks), e.g. ``sdpo_teacher_context``: ``hint`` (default) or the SDPO paper's reprompt built from
    the ``uid`` group (``success``, ``feedback``, ``success+feedback``).
    """

    hint_fn: str | None = None
    env: str | None = None
    hint_role: str = "user"
    pair_source: str | None = None
    pairs_per_step: int = 1
    replay_pairs: ReplayPairs = ReplayPairOptions.replay_pairs

    def __post_init__(self) -> None:
        if self.hint_role not in ("user", "system"):
            raise ValueError(f"composer.hint_role={self.hint_role!r} must be 'user' or 'system'.")
        if not isinstance(self.pairs_per_step, int) or self.pairs_per_step < 1:
            raise ValueError(f"composer.pairs_per_step={self.pairs_per_step!r} must be an integer >= 1.")
        if self.env is not None and self.hint_fn is not None:
            raise ValueError(
                f"composer.env={self.env!r} and composer.hint_fn={self.hint_fn!r} are both set: the environment's "
                "feedback is the hint, so drop one of them."
            )
        # with replay_pairs=on_policy channel 3 reads success_reward_threshold too: the 'hint' context accepts it
        kw = {f.name: getattr(self, f.name) for f in fields(TeacherContextOptions)}
        if self.replay_pairs == "on_policy" and self.sdpo_teacher_context == "hint":
            kw.pop("success_reward_threshold")
        try:
            TeacherContextOptions(**kw)
            ReplayPairOptions(self.replay_pairs)
        except ValueError as err:
            raise ValueError(f"composer section: {err}") from None
        if self.replay_pairs == "on_policy" and self.pair_source != "dataset":
            raise ValueError(
                f"composer.replay_pairs=on_policy pairs each failed response with its row's `chosen` column: set "
                f"composer.pair_source=dataset (it is {self.pair_source!r}) or use composer.replay_pairs=columns."
            )
        has_text = self.hint_fn is not None or self.env is not None
        if self.sdpo_teacher_context == "success" and has_text:
            raise ValueError(
                "composer.hint_fn / composer.env is not read with composer.sdpo_teacher_context=success (successful "
                "siblings are the only teacher context); use success+feedback to add its text as feedback, or drop it."
            )
        if self.uses_feedback and not has_text:
            raise ValueError(
                f"composer.sdpo_teacher_context={self.sdpo_teacher_context} needs each completion's feedback: set "
                "composer.env (the environment's feedback) or composer.hint_fn (its text is the feedback), or use "
                "success."
            )
        if self.hint_role != "user" and self.from_group:
            raise ValueError(
                f"composer.hint_role={self.hint_role!r} acts only with composer.sdpo_teacher_context=hint (the group "
                "contexts replace the last user turn); drop it."
            )

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None) -> ProducerConfig:
        mapping = dict(mapping or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(f"composer section: unknown key(s) {unknown}; valid keys: {sorted(known)}.")
        if "pairs_per_step" in mapping:
            mapping["pairs_per_step"] = int(mapping["pairs_per_step"])  # CLI values arrive as strings
        return cls(**mapping)

    @property
    def enabled(self) -> bool:
        return self.hints or self.pair_source is not None

    @property
    def hints(self) -> bool:
        """Channel 2 is produced (a hint function, an environment, or the group's successes)."""
        return self.hint_fn is not None or self.env is not None or self.from_group


def load_hint_fn(path: str) -> HintFn:
    """Import ``module:function`` or ``module.function``; raise naming the key when it is not callable."""
    from composer_core.traces.hints import load_hint_fn as load

    return load(path, option="composer.hint_fn")


def check_settings(
    producers: ProducerConfig, alpha_sdpo: float, beta_replay: float, actor: Mapping[str, Any]
) -> None:
    """Refuse configurations where a producer would have no effect, or pairs could be split."""
    if producers.hints and alpha_sdpo <= 0:
        raise ValueError(
            "composer.hint_fn / composer.env / composer.sdpo_teacher_context produce channel 2 but alpha_sdpo is 0 "
            "in COMPOSER_VERL_CONFIG: set alpha_sdpo > 0."
        )
    if producers.pair_source is not None:
        if beta_replay <= 0:
            raise ValueError(
                "composer.pair_source is set but beta_replay is 0 in COMPOSER_VERL_CONFIG: set beta_replay > 0."
            )
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


# --- tokenisation of hinted contexts and pair rows -----------------------------------------------------------


def _as_messages(raw_prompt: Any) -> list[dict[str, Any]]:
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    return [dict(m) for m in raw_prompt]


def render_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Prompt token ids the way verl's agent loop renders them (chat template, generation prompt)."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # transformers >= 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def hinted_prompt_ids(tokenizer: Any, raw_prompt: Any, hint: str, role: str = "user") -> list[int]:
    """Teacher context: the prompt messages + one hint message, rendered with the generation prompt."""
    return render_prompt_ids(tokenizer, [*_as_messages(raw_prompt), {"role": role, "content": hint}])


def context_prompt_ids(tokenizer: Any, context: Any, max_len: int | None) -> list[int]:
    """A group-built teacher context (text or chat messages) rendered with the generation prompt, keeping its
    last ``max_len`` tokens (composer_core's :func:`~composer_core.sdpo.cap_reprompt`)."""
    from composer_core.sdpo import cap_reprompt

    return cap_reprompt(render_prompt_ids(tokenizer, _as_messages(context)), max_len)


@dataclass
class GroupContexts:
    """:func:`group_teacher_contexts`' answer: the teacher context of each distilled row (by row index) and
    composer_core's counters summed over the batch (``metrics``: the fractions TRL's adapter logs too)."""

    contexts: dict[int, Any]
    metrics: dict[str, float]


def group_teacher_contexts(
    rows: Sequence[int],
    uids: Sequence[str],
    prompts: Sequence[Any],
    completions: Sequence[str],
    rewards: Sequence[float],
    options: TeacherContextOptions,
    feedback: Sequence[str | None] | None = None,
    seed: int = 0,
) -> GroupContexts:
    """composer_core's :func:`~composer_core.sdpo.build_teacher_contexts` on verl rows grouped by ``uid``.

    ``rows`` are the row indices taking part (``uids``/``prompts``/... are indexed by them); a group is every row
    with the same uid, wherever it sits in the batch (verl does not keep a group contiguous after balancing or
    when an agent loop returns rows out of order). Groups are handed to core in order of first appearance, one
    call per group size (a group of G rows is one core group).
    """
    groups: dict[str, list[int]] = {}
    for i in rows:
        groups.setdefault(str(uids[i]), []).append(i)
    by_size: dict[int, list[int]] = {}
    for members in groups.values():
        by_size.setdefault(len(members), []).extend(members)
    out: dict[int, Any] = {}
    groups_seen = with_success = with_solution = with_feedback = masked = 0
    for size, order in by_size.items():
        ctx = build_teacher_contexts(
            [prompts[i] for i in order],
            [completions[i] for i in order],
            [rewards[i] for i in order],
            size,
            options,
            feedback=None if feedback is None else [feedback[i] for i in order],
            seed=seed,
        )
        out.update((i, ctx.contexts[k]) for k, i in enumerate(order) if ctx.mask[k])
        groups_seen += ctx.groups
        with_success += ctx.groups_with_success
        with_solution += ctx.with_solution
        with_feedback += ctx.with_feedback
        masked += sum(ctx.mask)
    n = max(len(rows), 1)
    metrics = {
        "success_group_fraction": with_success / max(groups_seen, 1),
        "success_sample_fraction": with_solution / n,
        "feedback_used_fraction": with_feedback / n,
        "reprompt_sample_fraction": masked / n,
    }
    return GroupContexts(out, metrics)


def with_prompt(
    sample: Mapping[str, Any], prompt_ids: Sequence[int], responses: torch.Tensor | None = None
) -> dict[str, Any]:
    """A copy of one no-padding sample whose prompt is replaced by ``prompt_ids`` (and its response by
    ``responses`` when given); ``input_ids``, ``position_ids`` and an ``attention_mask`` (all ones) rebuilt."""
    out = {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in sample.items()}
    prompts = torch.tensor(list(prompt_ids), dtype=torch.int64)
    if responses is not None:
        out["responses"] = responses
    input_ids = torch.cat([prompts, out["responses"].to(torch.int64)])
    positions = torch.arange(input_ids.numel(), dtype=torch.int64)
    template = sample.get("position_ids")
    if isinstance(template, torch.Tensor) and template.dim() > 1:
        positions = positions.reshape(1, -1).expand(template.shape[0], -1).clone()
    out.update(prompts=prompts, input_ids=input_ids, position_ids=positions)
    if "attention_mask" in out:  # verl's agent loop stores no attention mask (all ones, no padding)
        out["attention_mask"] = torch.ones_like(input_ids)
    return out


def response_ids(tokenizer: Any, text: str, length: int) -> list[int]:
    """Token ids of a pair's response text + EOS, truncated to ``length`` (verl's response length)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError(f"pair response {text[:40]!r} tokenises to nothing")
    return ids[:length]


def pair_sample(
    template: Mapping[str, Any], prompt_ids: Sequence[int], resp_ids: Sequence[int]
) -> dict[str, Any]:
    """One appended pair row built on a real sample (same fields), zero reward, full response mask."""
    out = with_prompt(template, prompt_ids, torch.tensor(list(resp_ids), dtype=torch.int64))
    ones = torch.ones(len(resp_ids), dtype=torch.int64)
    zeros = torch.zeros(len(resp_ids), dtype=torch.float32)
    out.update(
        response_mask=ones,
        rm_scores=zeros,
        rollout_log_probs=zeros.clone(),
        uid=f"composer-pair-{uuid.uuid4().hex}",
    )
    if "loss_mask" in out:
        out["loss_mask"] = ones.clone()
    if "num_turns" in out:
        out["num_turns"] = 1
    return out


def pairs_last(keys: Sequence[str], pairs: Sequence[tuple[str, str]]) -> list[int]:
    """Reorder indices: every non-pair row in its order, then each pair as (chosen, rejected)."""
    index = {k: i for i, k in enumerate(keys)}
    in_pairs = {k for p in pairs for k in p}
    return [i for i, k in enumerate(keys) if k not in in_pairs] + [index[k] for p in pairs for k in p]


def reward_extra(sample: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extra`` handed to ``hint_fn``: the reward function's extra info (verl's agent loop keeps it under
    ``extra_fields["reward_extra_info"]``, e.g. ``{"feedback": ...}``) merged over the row's non-tensor fields
    (dataset columns such as ``reward_model``, ``extra_info``, ``raw_prompt``)."""
    extra = {k: v for k, v in sample.items() if not isinstance(v, torch.Tensor)}
    fields_ = extra.get("extra_fields")
    info = fields_.get("reward_extra_info") if isinstance(fields_, Mapping) else None
    if isinstance(info, Mapping):
        extra.update(info)
    return extra


# --- pair sources ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairText:
    prompt: list[dict[str, Any]]
    chosen: str
    rejected: str


def _message_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and len(value) == 1 and isinstance(value[0], Mapping):
        content = value[0].get("content")
        if isinstance(content, str):
            return content
    raise ValueError(
        f"a pair's chosen/rejected must be text or one message with text content, got {value!r:.80}"
    )


class RecordPairs:
    """Channel-3 pairs from a ``composer_core.traces.records`` file, ``n`` per step, cycling in file order."""

    def __init__(self, path: str | Path, n: int) -> None:
        from composer_core.traces.records import read_records

        self.pairs = [
            PairText(list(r.prompt), _message_text(r.chosen), _message_text(r.rejected))
            for r in read_records(path)
            if r.has_pair
        ]
        if not self.pairs:
            raise ValueError(
                f"composer.pair_source={str(path)!r}: the records file holds no pair (chosen/rejected)."
            )
        self.n = n
        self.cursor = 0

    def take(self) -> list[PairText]:
        out = [self.pairs[(self.cursor + i) % len(self.pairs)] for i in range(self.n)]
        self.cursor = (self.cursor + self.n) % len(self.pairs)
        return out


def on_policy_pair_rows(
    samples: Sequence[Mapping[str, Any]], threshold: float, tokenizer: Any, length: int
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(chosen, rejected) rows of ``replay_pairs=on_policy``: for each failed response (Σ ``rm_scores`` <
    ``threshold``), its row's ``chosen`` text against a copy of the response itself, both after its own prompt."""
    for s in samples:
        if "rm_scores" not in s:
            raise ValueError(
                "composer.replay_pairs=on_policy needs each row's reward (rm_scores): run it in verl's v1 loop "
                "(trainer.v1.trainer_mode=composer_sync) with a reward function."
            )
        check_on_policy_columns(s.keys())
    out = []
    for i in failed_rows([float(s["rm_scores"].sum()) for s in samples], 1, threshold):
        s = samples[i]
        if s["chosen"] is None:
            raise ValueError(
                "composer.replay_pairs=on_policy: a failed row has no `chosen` answer; fill the column."
            )
        prompt = s["prompts"].tolist()
        chosen = pair_sample(s, prompt, response_ids(tokenizer, _message_text(s["chosen"]), length))
        rejected = pair_sample(s, prompt, s["responses"].tolist())
        for key in (
            "response_mask",
            "loss_mask",
        ):  # the response's own mask (multi-turn: tool tokens stay out)
            if key in s and key in rejected:
                rejected[key] = s[key].clone()
        out.append((chosen, rejected))
    return out


def dataset_pairs(samples: Sequence[Mapping[str, Any]]) -> list[PairText]:
    """One pair per prompt group (``uid``) from the rows' ``chosen``/``rejected`` dataset columns."""
    seen: set[str] = set()
    out: list[PairText] = []
    for s in samples:
        if "chosen" not in s or "rejected" not in s:
            raise ValueError(
                "composer.pair_source=dataset but the rollout rows have no 'chosen'/'rejected' fields: add those "
                "columns to the training data."
            )
        uid = str(s.get("uid"))
        if uid in seen or s["chosen"] is None or s["rejected"] is None:
            continue
        seen.add(uid)
        out.append(
            PairText(_as_messages(s["raw_prompt"]), _message_text(s["chosen"]), _message_text(s["rejected"]))
        )
    return out


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
    """Runs the producers on one step's ``KVBatchMeta`` (driver side, inside ``ComposerPPOTrainerSync``).

    ``teacher``/``form``: ``COMPOSER_VERL_CONFIG``'s ``sdpo_teacher`` (live, ema or base) and ``sdpo_form``
    (``sampled``: the teacher log-probs are computed here; ``topk``: inside the actor's training forward)."""

    def __init__(
        self,
        config: ProducerConfig,
        tokenizer: Any,
        response_length: int,
        teacher: str = "live",
        form: str = "sampled",
    ) -> None:
        self.config = config
        self.teacher = teacher
        self.form = form
        self.tokenizer = tokenizer
        self.response_length = response_length
        self.hint_fn: HintFn | None = load_hint_fn(config.hint_fn) if config.hint_fn else None
        if config.env is not None:
            from composer_verl.envs import env_hint_fn

            self.hint_fn = env_hint_fn(config.env)
        self.records: RecordPairs | None = None
        if config.pair_source not in (None, "dataset"):
            self.records = RecordPairs(config.pair_source, config.pairs_per_step)
        self.pair_keys: list[tuple[str, str]] = []

    @classmethod
    def from_trainer_config(cls, config: Any, tokenizer: Any) -> ComposerProducers | None:
        from omegaconf import OmegaConf

        from composer_verl.config import current_config

        section = config.get("composer", None)
        mapping = OmegaConf.to_container(section, resolve=True) if section is not None else {}
        producers = ProducerConfig.from_mapping(mapping)  # type: ignore[arg-type]
        composer = current_config()
        if not producers.hints and composer.sdpo_teacher != "live":
            raise ValueError(
                f"sdpo_teacher={composer.sdpo_teacher!r} in COMPOSER_VERL_CONFIG scores channel 2's teacher contexts, "
                "but the composer section produces none: set composer.sdpo_teacher_context (e.g. success), "
                "composer.hint_fn or composer.env, or drop sdpo_teacher."
            )
        if not producers.enabled:
            return None
        actor = OmegaConf.to_container(config.actor_rollout_ref.actor, resolve=True)
        check_settings(producers, composer.alpha_sdpo, composer.beta_replay, actor)  # type: ignore[arg-type]
        length = int(config.data.max_response_length)
        return cls(producers, tokenizer, length, composer.sdpo_teacher, composer.sdpo_form)

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
        if self.form == "topk":
            fields[TEACHER_PROMPTS] = _nested(
                [
                    torch.tensor(teacher_prompts[i], dtype=torch.int64)
                    if i in teacher_prompts
                    else s["prompts"].to(torch.int64)
                    for i, s in enumerate(samples)
                ]
            )
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
        opts = self.config
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
        opts, n = self.config, len(samples)
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
            prompts[i] = raw if isinstance(raw, str) else _as_messages(raw)
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
