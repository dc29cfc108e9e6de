"""A ``transformers.TrainerCallback`` that runs torchft's DiLoCo inside any HF/TRL trainer: replicas
sync every ``config.sync_every`` *optimiser* steps. Install with ``pip install 'composer-diloco[trl]'``.
"""

from __future__ import annotations

from typing import Any

from ._optional import require
from .diloco import DiLoCoConfig, build_diloco

_transformers = require("transformers", "trl", "DiLoCoCallback")


class DiLoCoCallback(_transformers.TrainerCallback):  # type: ignore[misc, name-defined]
    """Wrap the trainer's optimiser in torchft's DiLoCo from ``on_train_begin`` to ``on_train_end``.

    Args:
        manager: a torchft ``Manager`` (``use_async_quorum=False``) or an ``ObjectStoreManager``.
        config: the :class:`~composer_diloco.DiLoCoConfig` (``sync_every`` = H optimiser steps).
    """

    def __init__(self, manager: Any, config: DiLoCoConfig) -> None:
        if not isinstance(config, DiLoCoConfig):
            raise ValueError(f"config must be a DiLoCoConfig, got {type(config).__name__}.")
        self.manager = manager
        self.config = config
        self.diloco: Any = None

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        if model is None or optimizer is None:
            raise ValueError("DiLoCoCallback needs the trainer's model and optimizer in on_train_begin.")
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        self.diloco = build_diloco(self.manager, model, inner, self.config)
        self.diloco.__enter__()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
            self.diloco = None

    @property
    def syncs(self) -> int:
        """Committed DiLoCo syncs so far (the manager's step)."""
        return int(self.manager.current_step())
