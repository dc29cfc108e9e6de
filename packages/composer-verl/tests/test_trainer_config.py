"""The shipped example config composes with verl's own Hydra config and selects the composer pieces."""

from __future__ import annotations

from importlib.resources import files

import composer_verl.plugin  # noqa: F401
import pytest
from hydra import compose, initialize_config_dir


@pytest.fixture(scope="module")
def config():
    """Compose the shipped YAML exactly as `main_ppo --config-path=<examples> --config-name=composer_grpo` does."""
    examples = str(files("composer_verl.examples"))
    with initialize_config_dir(config_dir=examples, version_base=None):
        return compose(config_name="composer_grpo")


def test_example_selects_composer(config) -> None:
    from composer_verl.config import ComposerVerlConfig, section_of

    assert "env_vars" not in config.ray_kwargs.ray_init.get(
        "runtime_env", {}
    )  # no second path for the options
    assert (
        ComposerVerlConfig.from_mapping(section_of(config)) == ComposerVerlConfig()
    )  # +composer.<key>=... adds
    assert config.actor_rollout_ref.rollout.n == 8  # our value over verl's default
    assert config.algorithm.adv_estimator == "grpo_composer"
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "composer"
    assert config.trainer.v1.trainer_mode == "composer_sync"
    assert config.trainer.use_v1 is True


def test_verl_accepts_the_config(config) -> None:
    """verl's own validation (run by main_ppo before anything starts) and its dataclass conversion."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import PolicyLossConfig

    validate_config(
        config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
    )
    assert not need_critic(config)  # grpo_composer is critic-free, like grpo
    loss_cfg = omega_conf_to_dataclass(config.actor_rollout_ref.actor.policy_loss, PolicyLossConfig)
    assert loss_cfg.loss_mode == "composer"


def test_trainer_mode_maps_actor_roles_to_the_composer_worker(config) -> None:
    from composer_verl.actor import ComposerActorRolloutRefWorker
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    cls = get_trainer_cls(config.trainer.v1.trainer_mode)
    assert issubclass(cls, PPOTrainerSync)
    trainer = object.__new__(cls)  # only the resource-pool step, no Ray cluster
    trainer.config = config
    trainer._init_resource_pool_mgr()
    actor_classes = [a.__ray_metadata__.modified_class for a in trainer.role_worker_mapping.values()]
    assert actor_classes and all(issubclass(c, ComposerActorRolloutRefWorker) for c in actor_classes)
