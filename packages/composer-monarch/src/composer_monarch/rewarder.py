"""The rewarder: runs reward functions / verifiers on completions (TorchForge's ``RewardActor``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from monarch.actor import endpoint
from torch import Tensor

from composer_monarch.policy_copy import ProcessActor
from composer_monarch.rollout import Rollout

RewardFn = Callable[[Tensor, Tensor], float]


def score(rollout: Rollout, reward_fns: Sequence[RewardFn], weights: Sequence[float]) -> Tensor:
    """r_i = Σ_f w_f · f(prompt_i, completion_i) with each completion cut at its mask; [B] float32."""
    out = torch.zeros(rollout.prompt_ids.shape[0])
    for i in range(out.numel()):
        completion = rollout.completion_ids[i][rollout.completion_mask[i].bool()]
        total = 0.0
        for fn, w in zip(reward_fns, weights):
            r = float(fn(rollout.prompt_ids[i], completion))
            if not math.isfinite(r):
                name = getattr(fn, "__name__", type(fn).__name__)
                raise ValueError(f"reward function {name} returned {r} for row {i}: rewards must be finite")
            total += w * r
        out[i] = total
    return out


class RewarderActor(ProcessActor):
    """Scores rollouts with a weighted sum of reward functions ``fn(prompt [P], completion [t]) -> float``."""

    def __init__(self, reward_fns: Sequence[RewardFn], weights: Sequence[float] | None = None) -> None:
        if not reward_fns:
            raise ValueError("RewarderActor needs at least one reward function")
        if weights is not None and len(weights) != len(reward_fns):
            raise ValueError(f"weights has {len(weights)} entries for {len(reward_fns)} reward functions")
        self.reward_fns = list(reward_fns)
        self.weights = list(weights) if weights is not None else [1.0] * len(reward_fns)

    @endpoint
    def score(self, rollout: Rollout) -> Tensor:
        return score(rollout, self.reward_fns, self.weights)
