"""The receiving side of the weight push, shared by every actor that holds a copy of the policy.

The generator samples with the policy and the teacher reads hinted contexts with it; both take the
trainer's weights each step through the same endpoints (shared memory, Monarch ``RDMABuffer``, one
direct message, or a state dict for in-process use), so they inherit them from :class:`PolicyCopyActor`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from monarch.actor import Actor, endpoint
from torch import Tensor, nn

from composer_monarch.weights import WeightLayout, WeightReceiver, host_id


def state_copy(model: nn.Module) -> dict[str, Tensor]:
    """A detached copy of ``model``'s state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class ProcessActor(Actor):
    """An actor that reports its OS process id (``ComposerDriver.process_ids``)."""

    @endpoint
    def process_id(self) -> int:
        return os.getpid()


class PolicyCopyActor(ProcessActor):
    """An actor holding a frozen copy of the policy (``model``, at weight ``version``), loaded from the trainer.

    Subclasses call ``super().__init__(model_fn, who, num_threads)``.
    """

    def __init__(self, model_fn: Callable[[], nn.Module], who: str, num_threads: int | None) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model = model_fn().eval().requires_grad_(False)
        self.version = 0
        self.receiver = WeightReceiver(self.model, who)

    def loaded(self, version: int) -> None:
        """Called after every load of the trainer's weights (``version``); the teacher's EMA hooks in here."""

    def _at(self, version: int, result: int) -> int:
        self.version = version
        self.loaded(version)
        return result

    @endpoint
    def update_weights(self, version: int, state: dict[str, Tensor]) -> int:
        """Load a state dict (in-process use and the bench's baseline; the loop uses pull/load_weights)."""
        try:
            self.model.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise ValueError(
                f"{self.receiver.who}: the weights do not fit its model (same model factory?): {e}"
            ) from e
        return self._at(version, version)

    @endpoint
    def pull_weights(self, version: int, layout: WeightLayout, source: object, timeout_s: float) -> int:
        """Read the trainer's packed weights from its RDMA buffer ``source``; returns the bytes read."""
        return self._at(version, self.receiver.pull(layout, source, timeout_s))

    @endpoint
    def map_weights(self, version: int, layout: WeightLayout, path: str) -> int:
        """Copy the trainer's packed weights out of its shared-memory buffer at ``path`` (same host)."""
        return self._at(version, self.receiver.map_shared(layout, path))

    @endpoint
    def load_weights(self, version: int, layout: WeightLayout, flat: Tensor) -> int:
        """Load packed weights sent by the trainer in one message; returns the bytes."""
        return self._at(version, self.receiver.load(layout, flat))

    @endpoint
    def host(self) -> str:
        """This process's host identity (the trainer's same-host check for the shm transport)."""
        return host_id()

    @endpoint
    def weights(self) -> tuple[int, dict[str, Tensor]]:
        """(version, a copy of the state dict): for tests and checks, not for the loop."""
        return self.version, state_copy(self.model)
