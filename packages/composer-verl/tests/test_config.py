"""The plugin-owned config section: sources, precedence and clear errors."""

from __future__ import annotations

import pytest
from composer_verl.config import ComposerVerlConfig, configure, current_config, parse_config


def test_defaults_are_channel_one_only() -> None:
    cfg = current_config()
    assert cfg == ComposerVerlConfig() and cfg.alpha_sdpo == 0.0 and cfg.beta_replay == 0.0


def test_inline_json_yaml_and_json_files(tmp_path) -> None:
    assert parse_config('{"alpha_sdpo": 0.5}').alpha_sdpo == 0.5
    y = tmp_path / "c.yaml"
    y.write_text("beta_replay: 0.25\ndpo_variant: simpo\n")
    assert parse_config(str(y)) == ComposerVerlConfig(beta_replay=0.25, dpo_variant="simpo")
    j = tmp_path / "c.json"
    j.write_text('{"adv_scale": "batch"}')
    assert parse_config(str(j)).adv_scale == "batch"


def test_configure_takes_precedence_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPOSER_VERL_CONFIG", '{"alpha_sdpo": 0.5}')
    assert current_config().alpha_sdpo == 0.5
    configure({"alpha_sdpo": 0.1})
    assert current_config().alpha_sdpo == 0.1
    configure(None)
    monkeypatch.setenv("COMPOSER_VERL_CONFIG", '{"alpha_sdpo": 0.7}')  # re-read when the variable changes
    assert current_config().alpha_sdpo == 0.7


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ('{"alpha": 1}', r"unknown key\(s\) \['alpha'\]"),
        ('{"adv_scale": "std"}', "adv_scale='std' is not one of"),
        ('{"alpha_sdpo": -1}', "composer-verl config: `alpha_sdpo`=-1.0 must be a finite weight >= 0"),
        ('{"beta_replay": NaN}', "composer-verl config: `beta_replay`=nan must be a finite weight >= 0"),
        ('{"policy_delta": 1.0}', "policy_delta=1.0 must be > 1"),
        (
            '{"sdpo_token_clip": 0}',
            r"composer-verl config: `is_clip \(sdpo_token_clip\)`=0.0 must be a finite number > 0",
        ),
        ('{"alpha_sdpo": ', "not valid JSON"),
        ("/no/such/file.yaml", "no such file"),
        ("[1, 2]", "no such file"),
    ],
)
def test_bad_config_is_a_clear_error(raw: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_config(raw)


def test_bad_env_config_fails_at_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPOSER_VERL_CONFIG", '{"alpha_sdpo": "high"}')
    with pytest.raises(ValueError, match="composer-verl config: `alpha_sdpo`='high'"):
        current_config()


def test_defaults_shared_with_core_come_from_core() -> None:
    from composer_core.loss.config import DPO, SDPOOptions, SimPO, flat_defaults

    cfg, core = ComposerVerlConfig(), flat_defaults()
    for key in (
        "sdpo_token_clip",
        "dpo_variant",
        "dpo_beta",
        "dpo_loss_type",
        "dpo_label_smoothing",
        "simpo_beta",
        "simpo_gamma",
    ):
        assert getattr(cfg, key) == core[key], key
    assert cfg.policy_delta == core["delta"]
    # the typed core config is built once with the section, and the loss reads it
    assert cfg.compose.replay == DPO() and cfg.compose.sdpo == SDPOOptions(form="sampled")
    assert ComposerVerlConfig(dpo_variant="simpo", simpo_gamma=0.2).compose.replay == SimPO(gamma=0.2)


@pytest.mark.parametrize(
    ("raw", "option"),
    [('{"simpo_gamma": 0.2}', "simpo_gamma"), ('{"dpo_variant": "simpo", "dpo_beta": 0.3}', "dpo_beta")],
)
def test_option_of_the_unselected_replay_variant_raises(raw: str, option: str) -> None:
    with pytest.raises(ValueError, match=f"composer-verl config: .*silently ignored: `{option}`"):
        parse_config(raw)


@pytest.mark.parametrize(
    ("bad", "option"),
    [
        ({"alpha_sdpo": -0.5}, "alpha_sdpo"),
        ({"alpha_sdpo": "high"}, "alpha_sdpo"),
        ({"beta_replay": float("inf")}, "beta_replay"),
        ({"sdpo_token_clip": -1.0}, "sdpo_token_clip"),
        ({"sdpo_form": "topk", "alpha_sdpo": 1.0, "sdpo_topk": 0}, "sdpo_topk"),
        ({"sdpo_form": "topk", "alpha_sdpo": 1.0, "sdpo_topk": 4, "sdpo_beta": 1.5}, "sdpo_beta"),
        (
            {"sdpo_form": "topk", "alpha_sdpo": 1.0, "sdpo_topk": 4, "sdpo_topk_tail": "maybe"},
            "sdpo_topk_tail",
        ),
        ({"dpo_variant": "kto"}, "dpo_variant"),
        ({"dpo_beta": 0.0}, "dpo_beta"),
        ({"dpo_loss_type": "hinge"}, "dpo_loss_type"),
        ({"dpo_label_smoothing": 0.7}, "dpo_label_smoothing"),
        ({"dpo_variant": "simpo", "simpo_beta": -2.0}, "simpo_beta"),
        ({"dpo_variant": "simpo", "simpo_gamma": float("nan")}, "simpo_gamma"),
    ],
)
def test_core_options_are_checked_by_core_only(bad: dict, option: str) -> None:
    """No range check of its own for an option shared with composer_core: the error is core's, prefixed once."""
    from composer_core.loss.config import ComposeConfig

    with pytest.raises(ValueError) as core:
        ComposeConfig.from_flat(**bad)
    with pytest.raises(ValueError) as verl:
        ComposerVerlConfig(**bad)
    assert str(verl.value) == f"composer-verl config: {core.value}"
    assert option in str(verl.value)


@pytest.mark.parametrize(
    "bad",
    [{"sdpo_teacher": "frozen"}, {"sdpo_teacher": "ema", "alpha_sdpo": 1.0, "teacher_update_rate": 0.0}],
)
def test_teacher_options_are_checked_by_core_only(bad: dict) -> None:
    from composer_core.sdpo import TeacherWeightsOptions

    with pytest.raises(ValueError) as core:
        TeacherWeightsOptions(**{k: v for k, v in bad.items() if k != "alpha_sdpo"})
    with pytest.raises(ValueError) as verl:
        ComposerVerlConfig(**bad)
    assert str(verl.value) == f"composer-verl config: {core.value}"
