"""The teacher: hinted-context logits for channel 2 and replay preference pairs for channel 3.

Channel 2 (SDPO): the teacher is the policy itself, reading a hinted context (the task's
``hinted_prompts``). It loads the trainer's weights each step, like the generator, and returns its
logits at the completion positions, detached.

Channel 3 (trace replay): ``replay`` holds actions of N teacher models on known prompts with their
rewards. For each sampled completion whose prompt has a replayed action with a higher reward, the best
such action becomes ``chosen`` and the student's completion ``rejected``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from composer_core.sdpo.teacher import TeacherWeightsOptions, ema_update_, frozen_copy
from monarch.actor import endpoint
from torch import Tensor, nn

from composer_monarch.model import completion_logits
from composer_monarch.policy_copy import PolicyCopyActor, state_copy
from composer_monarch.rollout import PreferencePairs, Rollout, pad_right

STASHED = 8
"""Hinted logits kept for the trainer to take (oldest dropped first): batches rolled out, not trained."""


@dataclass(frozen=True)
class ReplayRecord:
    """One replayed teacher action: prompt [P] long, completion [t] long (unpadded), its reward."""

    prompt_ids: Tensor
    completion_ids: Tensor
    reward: float
    source: str = "teacher"


def _key(prompt_ids: Tensor) -> tuple[int, ...]:
    return tuple(int(x) for x in prompt_ids.tolist())


def index_replay(records: Sequence[ReplayRecord]) -> dict[tuple[int, ...], ReplayRecord]:
    """The best record per prompt (highest reward; the first one on ties)."""
    best: dict[tuple[int, ...], ReplayRecord] = {}
    for r in records:
        key = _key(r.prompt_ids)
        if key not in best or r.reward > best[key].reward:
            best[key] = r
    return best


def preference_pairs(
    rollout: Rollout, rewards: Tensor, replay: dict[tuple[int, ...], ReplayRecord], pad_id: int
) -> PreferencePairs | None:
    """Pairs (best replayed action ≻ student completion) wherever the replayed reward is higher; None if none."""
    prompts, chosen, rejected, sources = [], [], [], []
    for i, prompt in enumerate(rollout.prompt_ids):
        rec = replay.get(_key(prompt))
        if rec is None or not rec.reward > float(rewards[i]):
            continue
        prompts.append(prompt)
        chosen.append(rec.completion_ids.long())
        rejected.append(rollout.completion_ids[i][rollout.completion_mask[i].bool()])
        sources.append(rec.source)
    if not prompts:
        return None
    return PreferencePairs(
        torch.stack(prompts), *pad_right(chosen, pad_id), *pad_right(rejected, pad_id), tuple(sources)
    )


class TeacherActor(PolicyCopyActor):
    """Hinted-context teacher (same model as the policy, synced each step) and replay pair builder."""

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        replay: Sequence[ReplayRecord] | None,
        pad_id: int,
        num_threads: int | None = None,
        weights: TeacherWeightsOptions | None = None,
    ) -> None:
        super().__init__(model_fn, "teacher", num_threads)
        self.replay = index_replay(replay) if replay else {}
        self.pad_id = pad_id
        self.stash: OrderedDict[str, Tensor] = OrderedDict()
        self.options = weights or TeacherWeightsOptions()
        self.teacher: nn.Module | None = None  # ema/base: its own weights; live: the policy copy itself

    def loaded(self, version: int) -> None:
        """The first load (the trainer's initial weights) makes the ema/base teacher; each later load whose
        version is a multiple of ``teacher_sync_steps`` moves the EMA teacher toward it (``ema_update_``)."""
        if self.options.sdpo_teacher == "live":
            return
        if self.teacher is None:
            self.teacher = frozen_copy(self.model)
        elif self.options.syncs_at(version):
            ema_update_(self.teacher, self.model, self.options.teacher_update_rate)

    @property
    def scoring_model(self) -> nn.Module:
        return self.model if self.teacher is None else self.teacher

    def _stash(self, key: str, logits: Tensor) -> tuple[int, ...]:
        self.stash[key] = logits
        while len(self.stash) > STASHED:
            self.stash.popitem(last=False)
        return tuple(logits.shape)

    @endpoint
    def teacher_weights(self) -> tuple[str, dict[str, Tensor]]:
        """(sdpo_teacher, a copy of the weights the teacher scores with): for tests and checks."""
        return self.options.sdpo_teacher, state_copy(self.scoring_model)

    @endpoint
    def context_logits(self, contexts: list[Tensor], completion_ids: Tensor, key: str) -> tuple[int, ...]:
        """Like :meth:`hinted_logits` (stashed under ``key``) for one context of its own length per row
        (contexts built from the group differ in length; each row is scored on its own, no padding)."""
        if len(contexts) != completion_ids.shape[0]:
            raise ValueError(
                f"{len(contexts)} teacher contexts for {completion_ids.shape[0]} completions: one per completion"
            )
        with torch.no_grad():
            rows = [
                completion_logits(self.scoring_model, c.long().view(1, -1), completion_ids[i : i + 1])
                for i, c in enumerate(contexts)
            ]
        return self._stash(key, torch.cat(rows).float())

    @endpoint
    def hinted_logits(self, hinted_prompt_ids: Tensor, completion_ids: Tensor, key: str) -> tuple[int, ...]:
        """Teacher logits [B, T, V] at the completion positions, given the hinted context, kept here under
        ``key`` for the trainer to :meth:`take_logits` (teacher → trainer, not through the driver); returns
        their shape."""
        if hinted_prompt_ids.shape[0] != completion_ids.shape[0]:
            raise ValueError(
                f"hinted_prompt_ids has {hinted_prompt_ids.shape[0]} rows, completion_ids "
                f"{completion_ids.shape[0]}: one hinted prompt per completion"
            )
        with torch.no_grad():
            logits = completion_logits(self.scoring_model, hinted_prompt_ids, completion_ids).float()
        return self._stash(key, logits)

    @endpoint
    def take_logits(self, key: str) -> Tensor:
        """The stashed logits of ``key`` (removed here): the trainer's call."""
        if key not in self.stash:
            raise KeyError(
                f"teacher: no hinted logits under {key!r} (taken already, or dropped after {STASHED} newer "
                "batches): train each rolled-out batch once, soon after its rollout"
            )
        return self.stash.pop(key)

    @endpoint
    def preference_pairs(self, rollout: Rollout, rewards: Tensor) -> PreferencePairs | None:
        return preference_pairs(rollout, rewards, self.replay, self.pad_id)
