"""The generator: samples completions with the current policy weights (TorchForge's ``Generator``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from monarch.actor import endpoint
from torch import Tensor, nn

from composer_monarch.policy_copy import PolicyCopyActor
from composer_monarch.rollout import Rollout, sample


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings. The sampling seed of step k is ``seed * 1_000_003 + k`` (reproducible)."""

    max_new_tokens: int
    eos_id: int
    pad_id: int
    temperature: float = 1.0
    seed: int = 0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be ≥ 1")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0 (greedy decoding is not sampling)")


class GeneratorActor(PolicyCopyActor):
    """Holds a copy of the policy (weights from the trainer: :class:`PolicyCopyActor`); ``generate`` samples."""

    def __init__(self, model_fn: Callable[[], nn.Module], config: SamplingConfig) -> None:
        super().__init__(model_fn, "generator", config.num_threads)
        self.config = config

    @endpoint
    def generate(self, step: int, prompt_ids: Tensor, group_size: int) -> Rollout:
        c = self.config
        prompts = prompt_ids.repeat_interleave(group_size, dim=0)
        g = torch.Generator().manual_seed(c.seed * 1_000_003 + step)
        ids, mask, logps = sample(
            self.model,
            prompts,
            max_new_tokens=c.max_new_tokens,
            eos_id=c.eos_id,
            pad_id=c.pad_id,
            temperature=c.temperature,
            generator=g,
        )
        return Rollout(step, prompts, ids, mask, logps, self.version, group_size)
