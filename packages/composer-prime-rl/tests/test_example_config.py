"""The shipped example configs parse, and their import_path resolves the way PRIME-RL does it.

PRIME-RL's ``prime_rl.utils.utils.import_object`` splits the dotted path on the LAST dot,
imports the module and ``getattr``s the name (no ``module:attr`` form, no registry);
``_import_object`` below does exactly that with plain importlib. The tables mirror
PRIME-RL's ``CustomLossConfig`` (``type = "custom"``, ``import_path``, ``kwargs``): the
combined ``rl`` config nests it under ``[trainer.loss]``, the standalone ``trainer``
command (root = ``TrainerConfig``) under ``[loss]``.
"""

from __future__ import annotations

import importlib
import tomllib
from typing import Any

import composer_prime_rl
import pytest
from composer_prime_rl import EXAMPLES, composer_loss, example_config, parse_options


def _import_object(dotted_path: str) -> Any:
    module_path, _, name = dotted_path.rpartition(".")
    return getattr(importlib.import_module(module_path), name)


def _loss_table(name: str) -> dict[str, Any]:
    with example_config(name).open("rb") as fh:
        config = tomllib.load(fh)
    return config["trainer"]["loss"] if name == "rl.toml" else config["loss"]


def test_examples_ship_inside_the_package() -> None:
    assert EXAMPLES == ("rl.toml", "trainer.toml")
    for name in EXAMPLES:
        assert example_config(name).is_file()
    with pytest.raises(ValueError, match="Unknown example"):
        example_config("sft.toml")


def test_rl_form_nests_the_loss_under_trainer() -> None:
    with example_config("rl.toml").open("rb") as fh:
        config = tomllib.load(fh)
    assert "loss" not in config  # the combined rl config has no root [loss]
    assert set(config["trainer"]["loss"]) == {"type", "import_path", "kwargs"}


def test_trainer_form_has_the_loss_at_the_root() -> None:
    with example_config("trainer.toml").open("rb") as fh:
        config = tomllib.load(fh)
    assert "trainer" not in config
    assert set(config["loss"]) == {"type", "import_path", "kwargs"}


@pytest.mark.parametrize("name", EXAMPLES)
def test_import_path_resolves_to_composer_loss(name) -> None:
    table = _loss_table(name)
    assert table["type"] == "custom"
    assert table["import_path"] == "composer_prime_rl.composer_loss"
    assert _import_object(table["import_path"]) is composer_prime_rl.composer_loss


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_kwargs_validate_and_run(make_inputs, name) -> None:
    kwargs = _loss_table(name)["kwargs"]
    opts = parse_options(kwargs)
    sample = make_inputs(
        p_train=[0.9, 0.5, 0.3], p_inf=[0.6, 0.6, 0.6], p_ref=[0.5, 0.4, 0.3], adv=[1.0, -0.5, 2.0]
    )
    fn = _import_object(_loss_table(name)["import_path"])
    out = fn(sample, **kwargs)
    assert out.loss.dim() == 0
    out.loss.backward()
    assert sample.trainer_logprobs.grad is not None
    if name == "rl.toml":
        assert opts.policy_loss == "dppo" and opts.config.alpha_sdpo == 0.0
        # PRIME-RL's defaults written out: identical to calling with no kwargs at all
        assert out.loss.item() == composer_loss(sample).loss.item()
    else:
        assert opts.policy_loss == "clipped_surrogate" and opts.config.alpha_sdpo == 0.5
        assert opts.config.policy.epsilon_high == 0.28 and opts.config.sdpo.token_clip == 2.0


def test_examples_validate_against_prime_rl_config_schema() -> None:
    """With PRIME-RL's config package installed (prime-rl-configs: Python 3.12, not on this CI),
    the examples validate as PRIME-RL's own pydantic configs and select CustomLossConfig."""
    pytest.importorskip("prime_rl.configs.trainer", reason="prime-rl-configs is not installed")
    from prime_rl.configs.rl import RLConfig
    from prime_rl.configs.trainer import CustomLossConfig, TrainerConfig

    with example_config("trainer.toml").open("rb") as fh:
        trainer = TrainerConfig.model_validate(tomllib.load(fh))
    assert isinstance(trainer.loss, CustomLossConfig)
    assert trainer.loss.kwargs == _loss_table("trainer.toml")["kwargs"]
    with example_config("rl.toml").open("rb") as fh:
        raw = tomllib.load(fh)
    assert isinstance(TrainerConfig.model_validate(raw["trainer"]).loss, CustomLossConfig)
    try:
        importlib.import_module("reverse_text")
    except ImportError:
        del raw["orchestrator"]["train"]["source"]  # the example's taskset package is absent
    rl = RLConfig.model_validate(raw)
    assert isinstance(rl.trainer.loss, CustomLossConfig)
    assert rl.trainer.loss.import_path == "composer_prime_rl.composer_loss"
