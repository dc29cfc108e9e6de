"""The teacher: hinted-context logits for channel 2 and replay preference pairs for channel 3.

Channel 2 (SDPO): the teacher is the policy itself, reading a hinted context (the task's
``hinted_prompts``). It loads the trainer's weights each step, like the generator, and returns its
logits at the completion positions, detached.

Channel 3 (trace replay): ``replay`` holds actions of N teacher models on known prompts with their
rewards. For each sampled completion whose prompt has a replayed action with a higher reward, the best
such action becomes ``chosen`` and the student's completion ``rejected``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from monarch.actor import Actor, endpoint
from torch import Tensor, nn

from composer_monarch.generator import load_weights
from composer_monarch.model import completion_logits
from composer_monarch.rollout import PreferencePairs, Rollout, pad_right


@dataclass(frozen=True)
class ReplayRecord:
    """One replayed teacher action: prompt [P] long, completion [t] long (unpadded), its reward."""

    prompt_ids: Tensor
    completion_ids: Tensor
    reward: float
    source: str = "teacher"


def index_replay(records: Sequence[ReplayRecord]) -> dict[tuple[int, ...], ReplayRecord]:
    """The best record per prompt (highest reward; the first one on ties)."""
    best: dict[tuple[int, ...], ReplayRecord] = {}
    for r in records:
        key = tuple(int(x) for x in r.prompt_ids.tolist())
        if key not in best or r.reward > best[key].reward:
            best[key] = r
    return best


def preference_pairs(
    rollout: Rollout, rewards: Tensor, replay: dict[tuple[int, ...], ReplayRecord], pad_id: int
) -> PreferencePairs | None:
    """Pairs (best replayed action ≻ student completion) wherever the replayed reward is higher.

    Returns None when no sampled completion is beaten by a replayed action.
    """
    prompts, chosen, rejected, sources = [], [], [], []
    for i in range(rollout.prompt_ids.shape[0]):
        rec = replay.get(tuple(int(x) for x in rollout.prompt_ids[i].tolist()))
        if rec is None or not rec.reward > float(rewards[i]):
            continue
        prompts.append(rollout.prompt_ids[i])
        chosen.append(rec.completion_ids.long())
        rejected.append(rollout.completion_ids[i][rollout.completion_mask[i].bool()])
        sources.append(rec.source)
    if not prompts:
        return None
    chosen_ids, chosen_mask = pad_right(chosen, pad_id)
    rejected_ids, rejected_mask = pad_right(rejected, pad_id)
    return PreferencePairs(
        torch.stack(prompts), chosen_ids, chosen_mask, rejected_ids, rejected_mask, tuple(sources)
    )


class TeacherActor(Actor):
    """Hinted-context teacher (same model as the policy, synced each step) and replay pair builder."""

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        replay: Sequence[ReplayRecord] | None,
        pad_id: int,
        num_threads: int | None = None,
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model = model_fn().eval().requires_grad_(False)
        self.replay = index_replay(replay) if replay else {}
        self.pad_id = pad_id
        self.version = 0

    @endpoint
    def update_weights(self, version: int, state: dict[str, Tensor]) -> int:
        load_weights(self.model, state, "teacher")
        self.version = version
        return version

    @endpoint
    def hinted_logits(self, hinted_prompt_ids: Tensor, completion_ids: Tensor) -> Tensor:
        """Teacher logits [B, T, V] at the completion positions, given the hinted context."""
        if hinted_prompt_ids.shape[0] != completion_ids.shape[0]:
            raise ValueError(
                f"hinted_prompt_ids has {hinted_prompt_ids.shape[0]} rows, completion_ids "
                f"{completion_ids.shape[0]}: one hinted prompt per completion"
            )
        with torch.no_grad():
            return completion_logits(self.model, hinted_prompt_ids, completion_ids).float()

    @endpoint
    def preference_pairs(self, rollout: Rollout, rewards: Tensor) -> PreferencePairs | None:
        return preference_pairs(rollout, rewards, self.replay, self.pad_id)

    @endpoint
    def process_id(self) -> int:
        return os.getpid()
