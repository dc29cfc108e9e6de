"""``[trainer.loss.kwargs]`` validation: every bad option raises, naming it and the fix."""

from __future__ import annotations

import pytest
from composer_prime_rl import PrimeRLLossOptions, composer_loss, parse_options, valid_option_names


@pytest.fixture
def sample(make_inputs):
    return make_inputs(p_train=[0.5, 0.6], p_inf=[0.5, 0.5], p_ref=[0.4, 0.4], adv=[1.0, -1.0])


def test_defaults_are_prime_rl_default_loss() -> None:
    opts = parse_options({})
    assert opts == PrimeRLLossOptions()
    policy = opts.config.policy
    assert (opts.policy_loss, policy.dppo_mask_low, policy.dppo_mask_high, opts.adv_tau, opts.kl_tau) == (
        "dppo",
        0.2,
        0.2,
        1.0,
        1e-3,
    )
    assert opts.config.alpha_sdpo == 0.0 and opts.config.beta_replay == 0.0
    assert policy.rollout_correction == "dppo_mask"
    assert opts.config.resolve(has_logits=False, has_hidden=False, has_sampled=True) == "sampled"


def test_unknown_kwarg_lists_the_valid_ones(sample) -> None:
    with pytest.raises(ValueError, match="Unknown option 'clip_eps'") as err:
        composer_loss(sample, clip_eps=0.2)
    for name in valid_option_names():
        assert name in str(err.value)


@pytest.mark.parametrize("key", ["sdpo_beta", "sdpo_temperature", "sdpo_topk", "sdpo_chunk_size"])
def test_full_vocabulary_options_raise(sample, key) -> None:
    with pytest.raises(ValueError, match="LossInputs has no logits"):
        composer_loss(sample, alpha_sdpo=1.0, **{key: 1})


@pytest.mark.parametrize("key", ["sdpo_wrapper", "taid_t", "taid_total_steps", "entropy_opd_threshold"])
def test_wrapper_options_raise(sample, key) -> None:
    with pytest.raises(ValueError, match="TAID / entropy-aware"):
        composer_loss(sample, alpha_sdpo=1.0, **{key: 1})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"beta_replay": 0.1},
        {"beta_replay": 1},
        {"dpo_beta": 0.1},
        {"dpo_variant": "simpo"},
        {"simpo_gamma": 0.5},
    ],
)
def test_channel3_raises_and_explains_folding_pairs_into_data(sample, kwargs) -> None:
    with pytest.raises(ValueError, match="once per sample") as err:
        composer_loss(sample, **kwargs)
    assert "Fold the pairs into the data" in str(err.value)


def test_beta_replay_zero_is_accepted(sample) -> None:
    assert composer_loss(sample, beta_replay=0.0).loss.item() == composer_loss(sample).loss.item()


@pytest.mark.parametrize("key", ["loss_type", "normalizer", "sdpo_normalizer", "max_completion_length"])
def test_aggregation_options_raise(sample, key) -> None:
    with pytest.raises(ValueError, match="divides by the global rl-token count"):
        composer_loss(sample, **{key: "dapo"})


@pytest.mark.parametrize("key", ["kl_beta", "kl_estimator", "rollout_correction", "rollout_clip_max"])
def test_other_compose_options_raise_with_a_reason(sample, key) -> None:
    with pytest.raises(ValueError, match=key):
        composer_loss(sample, **{key: 1})


@pytest.mark.parametrize(
    ("policy", "stray"),
    [
        ("dppo", {"epsilon_low": 0.2}),
        ("dppo", {"delta": 2.0}),
        ("clipped_surrogate", {"dppo_mask_high": 0.3}),
        ("clipped_surrogate", {"kl_tau": 0.0}),
    ],
)
def test_options_of_the_other_policy_loss_raise(sample, policy, stray) -> None:
    with pytest.raises(ValueError, match="only apply to the other policy loss"):
        composer_loss(sample, policy_loss=policy, **stray)


@pytest.mark.parametrize("key", ["sdpo_token_clip", "sdpo_missing", "sdpo_form"])
def test_sdpo_options_without_alpha_raise(sample, key) -> None:
    value = {"sdpo_token_clip": 2.0, "sdpo_missing": "skip", "sdpo_form": "sampled"}[key]
    with pytest.raises(ValueError, match="alpha_sdpo = 0"):
        composer_loss(sample, **{key: value})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy_loss": "grpo"}, "`policy_loss`='grpo' .* expected one of 'dppo', 'clipped_surrogate'"),
        ({"dppo_mask_low": -0.1}, r"`dppo_mask_low`=-0.1 must lie in \[0, 1\]"),
        ({"kl_tau": float("nan")}, "`kl_tau`=nan must be a finite number"),
        ({"adv_tau": "1.0x"}, r"`adv_tau`='1.0x' \(str\) is not a valid value: expected float"),
        ({"adv_tau": True}, r"`adv_tau`=True \(bool\) is not a valid value"),
        ({"alpha_sdpo": -1.0}, "`alpha_sdpo`=-1.0 must be a finite weight >= 0"),
        (
            {"alpha_sdpo": 1.0, "sdpo_token_clip": 0.0},
            r"`is_clip \(sdpo_token_clip\)`=0.0 must be a finite number > 0",
        ),
        ({"alpha_sdpo": 1.0, "sdpo_missing": "ignore"}, "`sdpo_missing`='ignore' .* expected one of"),
        (
            {"alpha_sdpo": 1.0, "sdpo_token_clip": float("inf")},
            r"`is_clip \(sdpo_token_clip\)`=inf must be a finite number",
        ),
        (
            {"alpha_sdpo": 1.0, "sdpo_token_clip": True},
            r"`sdpo_token_clip`=True \(bool\) is not a valid value",
        ),
        ({"policy_loss": "clipped_surrogate", "epsilon_low": 1.0}, r"`epsilon_low`=1.0 must lie in \[0, 1\)"),
        ({"policy_loss": "clipped_surrogate", "delta": 1.1}, r"`delta`=1.1 must exceed 1 \+ epsilon_high"),
    ],
)
def test_bad_values_raise(sample, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        composer_loss(sample, **kwargs)


def test_parse_is_cached_and_tolerates_unhashable_values() -> None:
    assert parse_options({"kl_tau": 0.0}) is parse_options({"kl_tau": 0.0})
    with pytest.raises(ValueError, match=r"`kl_tau`=\[0.0\] \(list\) is not a valid value"):
        parse_options({"kl_tau": [0.0]})


# ------------------------------------------------------------------ CLI-typed values and one source of defaults
def test_cli_string_values_are_coerced_like_a_typed_config(sample) -> None:
    # what `--loss.kwargs.KEY VALUE` on PRIME-RL's command line delivers: every value a string
    cli = {"alpha_sdpo": "0.25", "sdpo_token_clip": "false", "dppo_mask_low": "0.1", "kl_tau": "0"}
    opts = parse_options(cli)
    assert opts.config.alpha_sdpo == 0.25 and opts.config.sdpo.token_clip is None
    assert opts.config.policy.dppo_mask_low == 0.1
    assert opts.kl_tau == 0.0
    typed = {"alpha_sdpo": 0.25, "sdpo_token_clip": False, "dppo_mask_low": 0.1, "kl_tau": 0.0}
    assert composer_loss(sample, **cli).loss.item() == composer_loss(sample, **typed).loss.item()
    surrogate = parse_options({"policy_loss": "clipped_surrogate", "epsilon_high": "none", "delta": "2.5"})
    assert surrogate.config.policy.epsilon_high is None and surrogate.config.policy.delta == 2.5
    assert parse_options({"alpha_sdpo": "1", "sdpo_token_clip": "3"}).config.sdpo.token_clip == 3.0
    # PRIME-RL allows a DPPO bound above 1 (it masks nothing): read as core's largest bound, 1
    assert parse_options({"dppo_mask_high": "5"}).config.policy.dppo_mask_high == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha_sdpo": "0.25x"}, r"`alpha_sdpo`='0.25x' \(str\) is not a valid value: expected float"),
        (
            {"alpha_sdpo": "1", "sdpo_token_clip": "true"},
            "`sdpo_token_clip`='true' .* expected float or None",
        ),
        ({"policy_loss": "ppo"}, "`policy_loss`='ppo' .* expected one of"),
        ({"alpha_sdpo": "1", "sdpo_missing": "maybe"}, "`sdpo_missing`='maybe' .* expected one of"),
        ({"kl_tau": "-1"}, "`kl_tau`=-1.0 must be a finite number >= 0"),
    ],
)
def test_bad_cli_strings_name_the_key(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_options(kwargs)


def test_shared_defaults_come_from_composer_core() -> None:
    import inspect

    from composer_core.loss.config import flat_defaults
    from composer_core.loss.policy import dppo_loss

    core = flat_defaults()
    opts = PrimeRLLossOptions()
    flat = opts.config.to_flat()  # core's typed options: their defaults are core's
    for key in ("dppo_mask_low", "dppo_mask_high", "epsilon_low", "epsilon_high", "delta", "sdpo_token_clip"):
        assert flat[key] == core[key], key
    for key in ("w_policy", "alpha_sdpo", "beta_replay"):
        assert flat[key] == core[key], key
    sig = inspect.signature(dppo_loss).parameters
    assert (opts.adv_tau, opts.kl_tau) == (sig["adv_tau"].default, sig["kl_tau"].default)


def test_every_core_option_is_either_supported_or_refused_with_a_reason() -> None:
    from composer_core.loss.config import flat_option_names
    from composer_prime_rl.options import _UNSUPPORTED

    for key in flat_option_names():
        assert key in valid_option_names() or key in _UNSUPPORTED, key
    assert _UNSUPPORTED["rpo_alpha"] == _UNSUPPORTED["dpo_beta"]  # channel 3's reason, not channel 1's


@pytest.mark.parametrize(
    ("bad", "option"),
    [
        ({"alpha_sdpo": -0.5}, "alpha_sdpo"),
        ({"alpha_sdpo": float("nan")}, "alpha_sdpo"),
        ({"beta_replay": -1.0}, "beta_replay"),
        ({"alpha_sdpo": 1.0, "sdpo_token_clip": -1.0}, "sdpo_token_clip"),
        ({"alpha_sdpo": 1.0, "sdpo_token_clip": float("inf")}, "sdpo_token_clip"),
    ],
)
def test_core_channel_options_are_checked_by_core_only(bad, option) -> None:
    """No range check of its own for an option shared with composer_core's ComposeConfig: the error is core's."""
    from composer_core.loss.config import ComposeConfig

    with pytest.raises(ValueError) as core:
        ComposeConfig.from_flat(**bad)
    with pytest.raises(ValueError) as here:
        parse_options(bad)
    assert str(here.value) == str(core.value) and option in str(here.value)


@pytest.mark.parametrize(
    ("bad", "option"),
    [
        ({"epsilon_low": -0.1}, "epsilon_low"),
        ({"epsilon_low": 1.0}, "epsilon_low"),
        ({"epsilon_high": -0.5}, "epsilon_high"),
        ({"delta": 1.1}, "delta"),
        ({"delta": 0.5}, "delta"),
    ],
)
def test_clip_options_are_checked_by_core_only(bad, option) -> None:
    """epsilon_low / epsilon_high / delta raise composer_core's clipped_surrogate message."""
    import torch
    from composer_core.loss.policy import clipped_surrogate

    x = torch.zeros(1, 1)
    with pytest.raises(ValueError) as core:
        clipped_surrogate(x, x, torch.zeros(1), **bad)
    with pytest.raises(ValueError) as here:
        parse_options({"policy_loss": "clipped_surrogate", **bad})
    assert str(here.value) == str(core.value) and option in str(here.value)


def test_the_cache_keeps_value_types_apart() -> None:
    """1.0 and True hash alike: a cached 1.0 must not answer for a bool."""
    assert parse_options({"adv_tau": 1.0}).adv_tau == 1.0
    with pytest.raises(ValueError, match=r"`adv_tau`=True \(bool\) is not a valid value"):
        parse_options({"adv_tau": True})
