"""``trainer.v1.trainer_mode=composer_sync``: verl's synchronous v1 trainer with the composer actor.

``PPOTrainerSync`` with the actor roles mapped to :class:`composer_verl.actor.ComposerActorRolloutRefWorker` (the
way verl's ``PPOTrainerSeparateAsync`` swaps in its ``DetachActorWorker``), and, when the ``composer`` section
configures producers (:mod:`composer_verl.producers`), those run on each step's batch right before verl balances
it. The plugin registers this module lazily, after ``verl.trainer.ppo.v1`` finishes importing.
"""

from __future__ import annotations

from typing import Any

import ray
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from composer_verl.actor import ComposerActorRolloutRefWorker
from composer_verl.producers import ComposerProducers


@register_trainer("composer_sync")
class ComposerPPOTrainerSync(PPOTrainerSync):  # type: ignore[misc]
    """``PPOTrainerSync`` whose actor workers run the composer actor extension."""

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        for role in (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef):
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(ComposerActorRolloutRefWorker)

    def _init_tokenizer(self) -> None:
        super()._init_tokenizer()
        # config is checked here, once, before any worker starts
        self.composer_producers = ComposerProducers.from_trainer_config(self.config, self.tokenizer)

    def _balance_batch(self, batch: Any, metrics: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        producers = getattr(self, "composer_producers", None)
        if producers is None:
            return super()._balance_batch(batch, metrics, *args, **kwargs)
        batch = producers.before_balance(self, batch, metrics)
        batch = super()._balance_batch(batch, metrics, *args, **kwargs)
        return producers.after_balance(batch)
