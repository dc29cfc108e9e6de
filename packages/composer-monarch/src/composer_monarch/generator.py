"""The generator: samples completions with the current policy weights (TorchForge's ``Generator``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from monarch.actor import Actor, endpoint
from torch import Tensor, nn

from composer_monarch.rollout import Rollout, sample
from composer_monarch.weights import WeightLayout, WeightReceiver, host_id


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
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0")


def load_weights(model: nn.Module, state: dict[str, Tensor], who: str) -> None:
    """``load_state_dict(strict=True)`` with an error that says which actor got wrong weights."""
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{who}: the weights do not fit its model (same model factory?): {e}") from e


class GeneratorActor(Actor):
    """Holds a copy of the policy; ``update_weights`` loads the trainer's, ``generate`` samples."""

    def __init__(self, model_fn: Callable[[], nn.Module], config: SamplingConfig) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model = model_fn().eval().requires_grad_(False)
        self.version = 0
        self.receiver = WeightReceiver(self.model, "generator")

    @endpoint
    def update_weights(self, version: int, state: dict[str, Tensor]) -> int:
        """Load a state dict (in-process use and the bench's baseline; the loop uses pull/load_weights)."""
        load_weights(self.model, state, "generator")
        self.version = version
        return version

    @endpoint
    def pull_weights(self, version: int, layout: WeightLayout, source: object, timeout_s: float) -> int:
        """Read the trainer's packed weights from its RDMA buffer ``source``; returns the bytes read."""
        n = self.receiver.pull(layout, source, timeout_s)
        self.version = version
        return n

    @endpoint
    def map_weights(self, version: int, layout: WeightLayout, path: str) -> int:
        """Copy the trainer's packed weights out of its shared-memory buffer at ``path`` (same host)."""
        n = self.receiver.map_shared(layout, path)
        self.version = version
        return n

    @endpoint
    def host(self) -> str:
        """This process's host identity (the trainer's same-host check for the shm transport)."""
        return host_id()

    @endpoint
    def load_weights(self, version: int, layout: WeightLayout, flat: Tensor) -> int:
        """Load packed weights sent by the trainer in one message; returns the bytes."""
        n = self.receiver.load(layout, flat)
        self.version = version
        return n

    @endpoint
    def weights(self) -> tuple[int, dict[str, Tensor]]:
        """(version, a copy of the state dict): for tests and checks, not for the loop."""
        return self.version, {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @endpoint
    def generate(self, step: int, prompt_ids: Tensor, group_size: int) -> Rollout:
        if group_size < 1:
            raise ValueError(f"group_size={group_size}: must be ≥ 1")
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

    @endpoint
    def process_id(self) -> int:
        return os.getpid()
