"""The composer actor extension: the smallest change that gets batch fields into the policy loss.

verl 0.9's actor (``verl.workers.engine_workers``) trains through ``TrainingWorker``, whose engine
calls ``loss_fn(model_output=, data=<micro-batch TensorDict>, dp_group=)``; the actor's loss function is
``partial(ppo_loss, config=actor_config)``, which keeps only ``old_log_probs``, ``advantages``,
``response_mask``, ``rollout_is_weights`` and ``ref_log_prob`` before calling the registered policy loss.

Two subclasses, both using verl's own extension points:

* :class:`ComposerTrainingWorker` (``TrainingWorker``): ``set_loss_fn`` wraps whatever loss verl installs
  (``ppo_loss`` or ``distillation_ppo_loss``) with :func:`composer_verl.batch.with_composer_batch`, so the
  ``composer`` policy loss sees the micro-batch's composer keys; ``train_batch`` adds the global counts of
  SDPO tokens and preference pairs of the mini-batch (summed over data-parallel ranks), the way the engine
  adds ``batch_num_tokens`` for ``agg_loss``.
* :class:`ComposerActorRolloutRefWorker` (``ActorRolloutRefWorker``): sets the class attribute
  ``actor_worker_cls = ComposerTrainingWorker``; nothing else changes (rollout, reference, checkpoints).

Select it with ``trainer.v1.trainer_mode=composer_sync`` (see :mod:`composer_verl.trainer`).
"""

from __future__ import annotations

from typing import Any

import torch
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from composer_verl.batch import (
    GLOBAL_PREF_PAIRS,
    GLOBAL_SDPO_TOKENS,
    PREF_CHOSEN,
    PREF_PAIR_ID,
    SDPO_MASK,
    with_composer_batch,
)


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.values() if t.is_nested else t


def global_counts(data: Any, dp_group: Any = None) -> dict[str, float]:
    """SDPO tokens and preference pairs of a mini-batch ``TensorDict``, summed over ``dp_group``."""
    keys = data.keys()
    counts: dict[str, torch.Tensor] = {}
    if SDPO_MASK in keys:
        mask = data["response_mask"] if "response_mask" in keys else data["loss_mask"]
        sdpo = _values(data[SDPO_MASK]).bool() & _values(mask).bool()
        counts[GLOBAL_SDPO_TOKENS] = sdpo.sum().to(torch.float64)
    if PREF_PAIR_ID in keys and PREF_CHOSEN in keys:
        pairs = (data[PREF_PAIR_ID].reshape(-1) >= 0) & data[PREF_CHOSEN].reshape(-1).bool()
        counts[GLOBAL_PREF_PAIRS] = pairs.sum().to(torch.float64)
    if counts and torch.distributed.is_available() and torch.distributed.is_initialized():
        stacked = torch.stack(list(counts.values()))
        torch.distributed.all_reduce(stacked, op=torch.distributed.ReduceOp.SUM, group=dp_group)
        counts = dict(zip(counts, stacked, strict=True))
    return {k: float(v.item()) for k, v in counts.items()}


class ComposerTrainingWorker(TrainingWorker):  # type: ignore[misc]
    """verl ``TrainingWorker`` whose loss sees composer's batch keys (see module docstring)."""

    def set_loss_fn(self, loss_fn: Any) -> None:
        super().set_loss_fn(with_composer_batch(loss_fn) if loss_fn is not None else None)

    def train_batch(self, data: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        counts = global_counts(data, self.engine.get_data_parallel_group())
        if counts:
            tu.assign_non_tensor(data, **counts)
        return super().train_batch(data)


class ComposerActorRolloutRefWorker(ActorRolloutRefWorker):  # type: ignore[misc]
    """verl's hybrid actor/rollout/ref worker with :class:`ComposerTrainingWorker` as the actor."""

    actor_worker_cls = ComposerTrainingWorker
