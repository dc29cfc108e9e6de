"""The ``composer:`` section of verl's config: one source (Hydra), core's options, clear errors."""

from __future__ import annotations

import pytest
from composer_verl.config import CORE_OPTIONS, ComposerVerlConfig, configure, current_config, section_of

C = ComposerVerlConfig.from_mapping


def test_defaults_are_core_defaults_channel_one_only() -> None:
    from composer_core.loss.config import ComposeConfig, flat_defaults

    cfg, core = current_config(), flat_defaults()
    assert cfg == ComposerVerlConfig() == C({}) == C(None)
    assert cfg.compose == ComposeConfig()  # every core option's default is core's, nothing re-declared here
    simpo = C({"dpo_variant": "simpo", "beta_replay": 1.0}).compose.to_flat()
    flat = {**simpo, **cfg.compose.to_flat()}
    for key in CORE_OPTIONS:
        if key not in ("sdpo_form", "dpo_variant"):
            assert flat[key] == core[key], key
    assert cfg.compose.alpha_sdpo == core["alpha_sdpo"] and cfg.compose.beta_replay == core["beta_replay"]
    assert cfg.sdpo_form == "sampled"  # core's 'auto' resolved for verl's batch (sampled tokens only)


def test_the_environment_variable_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPOSER_VERL_CONFIG", '{"alpha_sdpo": 0.5}')
    assert current_config().compose.alpha_sdpo == ComposerVerlConfig().compose.alpha_sdpo
    assert configure({"alpha_sdpo": 0.1}) is current_config() and current_config().compose.alpha_sdpo == 0.1
    configure(None)
    assert current_config() == ComposerVerlConfig()


def test_section_reaches_driver_and_pickled_worker_node() -> None:
    """The driver reads ``composer`` from the root; a worker gets ``actor_rollout_ref`` (pickled by Ray), whose
    parent still holds the section."""
    from importlib.resources import files

    import cloudpickle
    from hydra import compose, initialize_config_dir

    overrides = ["+composer.alpha_sdpo=0.5", "+composer.sdpo_form=topk", "+composer.sdpo_topk=8"]
    with initialize_config_dir(config_dir=str(files("composer_verl.examples")), version_base=None):
        root = compose(config_name="composer_grpo", overrides=overrides)
    want = {"alpha_sdpo": 0.5, "sdpo_form": "topk", "sdpo_topk": 8}
    assert section_of(root) == want
    node = cloudpickle.loads(cloudpickle.dumps(root.actor_rollout_ref))
    assert section_of(node) == want
    assert C(section_of(node)).compose.sdpo.topk == 8
    with initialize_config_dir(config_dir=str(files("composer_verl.examples")), version_base=None):
        plain = compose(config_name="composer_grpo")
    assert section_of(plain) == {} == section_of(plain.actor_rollout_ref)


def test_cli_strings_are_coerced_by_core() -> None:
    cfg = C({"alpha_sdpo": "0.5", "sdpo_token_clip": "none", "adv_eps": "0.5", "pairs_per_step": "2"})
    assert (cfg.compose.alpha_sdpo, cfg.compose.sdpo.token_clip, cfg.adv_eps, cfg.pairs_per_step) == (
        0.5,
        None,
        0.5,
        2,
    )
    assert C({"dpo_variant": "simpo", "simpo_gamma": "0.2", "beta_replay": 1}).compose.replay.gamma == 0.2


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"alpha": 1}, r"unknown key\(s\) \['alpha'\]"),
        ({"sdpo_temperature": 2.0}, r"unknown key\(s\) \['sdpo_temperature'\]"),  # verl does not read it
        ({"adv_scale": "std"}, r"`composer.adv_scale`='std' .* expected one of 'group', 'batch', 'none'"),
        ({"adv_eps": -1.0}, "adv_eps=-1.0 must be a finite number >= 0"),
        ({"policy_delta": 1.0}, "policy_delta=1.0 must be > 1"),
        ({"hint_role": "bot"}, "hint_role"),
        ({"sdpo_form": "full", "alpha_sdpo": 1.0}, "verl computes channel 2 as 'sampled' or 'topk'"),
        ({"sdpo_topk": 4, "alpha_sdpo": 1.0}, "sdpo_topk"),  # core's auto form resolves to sampled in verl
        ({"pairs_per_step": 0}, "pairs_per_step=0 must be an integer >= 1"),
        ({"hint_fn": "m:f"}, "alpha_sdpo is 0"),
        ({"pair_source": "dataset"}, "beta_replay is 0"),
        ({"alpha_sdpo": 1.0, "hint_fn": "m:f", "env": "digit-reversal"}, "both set"),
        ({"alpha_sdpo": 1.0, "sdpo_teacher": "ema"}, "the section produces none"),
        ({"alpha_sdpo": 1.0, "hint_fn": "m:f", "sdpo_form": "topk", "sdpo_teacher": "ema"}, "topk"),
        ({"sdpo_teacher": "base", "hint_fn": "m:f"}, "alpha_sdpo is 0"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_bad_section_is_a_clear_error(bad: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        C(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "option"),
    [({"simpo_gamma": 0.2}, "simpo_gamma"), ({"dpo_variant": "simpo", "dpo_beta": 0.3}, "dpo_beta")],
)
def test_option_of_the_unselected_replay_variant_raises(raw: dict, option: str) -> None:
    with pytest.raises(ValueError, match=f"composer section: .*silently ignored: `{option}`"):
        C({"beta_replay": 1.0, **raw})


@pytest.mark.parametrize(
    "bad",
    [
        {"alpha_sdpo": -0.5},
        {"alpha_sdpo": "high"},
        {"beta_replay": float("inf")},
        {"sdpo_token_clip": -1.0},
        {"sdpo_form": "topk", "alpha_sdpo": 1.0, "sdpo_topk": 0},
        {"sdpo_form": "topk", "alpha_sdpo": 1.0, "sdpo_topk": 4, "sdpo_beta": 1.5},
        {"sdpo_form": "topk", "alpha_sdpo": 1.0, "sdpo_topk": 4, "sdpo_topk_tail": "maybe"},
        {"dpo_variant": "kto"},
        {"dpo_beta": 0.0},
        {"dpo_loss_type": "hinge"},
        {"dpo_label_smoothing": 0.7},
        {"dpo_variant": "simpo", "simpo_beta": -2.0},
        {"dpo_variant": "simpo", "simpo_gamma": float("nan")},
    ],
)
def test_core_options_are_checked_by_core_only(bad: dict) -> None:
    """No check of its own for an option shared with composer_core: the error is core's, prefixed once."""
    from composer_core.loss.config import ComposeConfig

    with pytest.raises(ValueError) as core:
        ComposeConfig.from_flat(**bad)
    with pytest.raises(ValueError) as verl:
        C(bad)
    assert str(verl.value) == f"composer section: {core.value}"


@pytest.mark.parametrize(
    "bad",
    [{"sdpo_teacher": "frozen"}, {"sdpo_teacher": "ema", "alpha_sdpo": 1.0, "teacher_update_rate": 0.0}],
)
def test_teacher_options_are_checked_by_core_only(bad: dict) -> None:
    from composer_core.sdpo import TeacherWeightsOptions

    with pytest.raises(ValueError) as core:
        TeacherWeightsOptions(**{k: v for k, v in bad.items() if k != "alpha_sdpo"})
    with pytest.raises(ValueError) as verl:
        C({**bad, "hint_fn": "m:f"})
    assert str(verl.value) == f"composer section: {core.value}"
