"""The SmolLM2-135M-Instruct recipe (``examples/smollm2-digit-reversal``) composes and validates as main_ppo would.

What runs: Hydra composes the recipe YAML exactly as ``main_ppo --config-path=<recipe dir>
--config-name=smollm2_digit_reversal`` does (its defaults = composer_verl's ``composer_grpo`` + verl's
``ppo_trainer``); verl's own ``validate_config`` and dataclass conversion accept it; composer's one
``composer:`` section parses with composer_verl's own parser; the
composer_sync trainer maps the actor roles to composer's worker. Then the same YAML at the e2e test's tiny size
(``verl_cpu_testkit.run.overrides``: the tiny Qwen2 + char tokenizer, 16 digit-reversal rows, 1 step) composes
and validates too.

What does not run here: main_ppo itself (the recipe needs a GPU and vLLM/SGLang; the CPU path is
``test_main_ppo_e2e.py``, ~3 min, with composer_grpo and the same composer section) and SmolLM2's weights.
"""

from __future__ import annotations

from pathlib import Path

import composer_verl.plugin  # noqa: F401
import pytest
from hydra import compose, initialize_config_dir

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "smollm2-digit-reversal"
NAME = "smollm2_digit_reversal"


def _compose(overrides: list[str] | None = None):  # type: ignore[no-untyped-def]
    with initialize_config_dir(config_dir=str(RECIPE), version_base=None):
        return compose(config_name=NAME, overrides=overrides or [])


def _validate(config) -> None:  # type: ignore[no-untyped-def]
    """What main_ppo checks before anything starts, plus composer's own sections."""
    from composer_verl.config import ComposerVerlConfig, section_of
    from composer_verl.producers import check_settings
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import PolicyLossConfig

    validate_config(
        config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
    )
    assert not need_critic(config)
    loss = omega_conf_to_dataclass(config.actor_rollout_ref.actor.policy_loss, PolicyLossConfig)
    assert loss.loss_mode == "composer"
    composer = ComposerVerlConfig.from_mapping(
        section_of(config)
    )  # every composer option in this one section
    check_settings(composer, OmegaConf.to_container(config.actor_rollout_ref.actor, resolve=True))  # type: ignore[arg-type]
    assert composer.env == "digit-reversal" and composer.pair_source == "dataset"


@pytest.fixture(scope="module")
def recipe():  # type: ignore[no-untyped-def]
    return _compose()


def test_recipe_selects_smollm2_and_composer(recipe) -> None:  # type: ignore[no-untyped-def]
    assert recipe.actor_rollout_ref.model.path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert recipe.algorithm.adv_estimator == "grpo_composer"
    assert recipe.actor_rollout_ref.actor.policy_loss.loss_mode == "composer"
    assert recipe.trainer.use_v1 and recipe.trainer.v1.trainer_mode == "composer_sync"
    assert recipe.reward.custom_reward_function.path == "pkg://composer_verl.envs"
    assert recipe.reward.custom_reward_function.reward_kwargs.env == "digit-reversal"
    assert recipe.composer.alpha_sdpo > 0 and recipe.composer.beta_replay > 0  # all three channels on
    assert "ray_kwargs" not in recipe or "env_vars" not in recipe.ray_kwargs.ray_init.get("runtime_env", {})


def test_verl_and_composer_accept_the_recipe(recipe) -> None:  # type: ignore[no-untyped-def]
    _validate(recipe)


def test_trainer_mode_uses_the_composer_worker(recipe) -> None:  # type: ignore[no-untyped-def]
    from composer_verl.actor import ComposerActorRolloutRefWorker
    from verl.trainer.ppo.v1 import get_trainer_cls

    trainer = object.__new__(get_trainer_cls(recipe.trainer.v1.trainer_mode))
    trainer.config = recipe
    trainer._init_resource_pool_mgr()  # only the resource-pool step, no Ray cluster
    classes = [a.__ray_metadata__.modified_class for a in trainer.role_worker_mapping.values()]
    assert classes and all(issubclass(c, ComposerActorRolloutRefWorker) for c in classes)


def test_recipe_at_the_e2e_tests_tiny_size(tmp_path: Path) -> None:
    """The recipe with the CPU e2e test's overrides (tiny model dir, its data, 1 step) composes and validates."""
    from verl_cpu_testkit.run import overrides

    # the e2e test appends keys composer_grpo lacks with "+"; the recipe sets some of them already: "++" = set
    tiny = ["+" + o if o.startswith("+") else o for o in overrides(tmp_path, steps=1)]
    config = _compose(tiny)
    assert config.trainer.total_training_steps == 1
    assert config.actor_rollout_ref.model.path == str(tmp_path / "model")
    assert (tmp_path / "model" / "config.json").is_file() and (tmp_path / "train.parquet").is_file()
    _validate(config)
