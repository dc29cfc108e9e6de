"""The rows the producers (:mod:`composer_verl.producers`) build: channel 2's teacher contexts (a hint message, or
the SDPO paper's reprompt from the row's ``uid`` group) rendered with the chat template the way verl's agent loop
renders prompts, and channel 3's pair rows built on a real sample. Pure functions of verl's no-padding samples: no
TransferQueue, no Ray.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from composer_core.sdpo import TeacherContextOptions, build_teacher_contexts
from composer_core.traces.onpolicy import check_on_policy_columns, failed_rows

# --- tokenisation of hinted contexts and pair rows -----------------------------------------------------------


def as_messages(raw_prompt: Any) -> list[dict[str, Any]]:
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
    return render_prompt_ids(tokenizer, [*as_messages(raw_prompt), {"role": role, "content": hint}])


def context_prompt_ids(tokenizer: Any, context: Any, max_len: int | None) -> list[int]:
    """A group-built teacher context (text or chat messages) rendered with the generation prompt, keeping its
    last ``max_len`` tokens (composer_core's :func:`~composer_core.sdpo.cap_reprompt`)."""
    from composer_core.sdpo import cap_reprompt

    return cap_reprompt(render_prompt_ids(tokenizer, as_messages(context)), max_len)


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
        # the response's own masks (multi-turn: tool tokens stay out)
        rejected.update((k, s[k].clone()) for k in ("response_mask", "loss_mask") if k in s and k in rejected)
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
            PairText(as_messages(s["raw_prompt"]), _message_text(s["chosen"]), _message_text(s["rejected"]))
        )
    return out
