"""`composer-train --env`: prompts, rewards and hints from an environment (composer_core.envs).

The OpenEnv run trains against a real server process (``python -m composer_core.envs.openenv_digit_reversal``
on 127.0.0.1, OpenEnv's own server classes) through OpenEnv's own client.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from composer_trl.cli import main, parse
from composer_trl.progress import read_jsonl


def channel_key(channel: str) -> str:
    """The metric key of a channel's loss (the one place to change when the keys move)."""
    return f"composer/loss/{channel}"


# 8 prompts x 8 completions of 2-digit tasks: every step has groups whose rewards differ (the tiny random
# model gets a digit right ~1 time in 13), so the policy channel has non-zero advantages at every step.
SMALL = ["--per_device_train_batch_size", "64", "--num_generations", "8", "--max_completion_length", "3"]


@pytest.fixture(scope="module")
def openenv_url() -> Iterator[str]:
    pytest.importorskip("openenv.core", reason="needs composer-core[openenv]")
    from composer_testkit.env_server import EnvServerProcess

    with EnvServerProcess("--n-tasks", "64", "--min-digits", "2", "--max-digits", "2") as srv:
        yield srv.url


def _assert_three_channels(out) -> list[dict]:
    """Every logged step trained all three channels.

    sdpo and replay: their losses are > 0 (with hinted tokens and pairs counted). policy: the rewards of the
    step are not all equal (non-zero advantages) and its loss is far from 0 (|loss| > 1e-6; GRPO's loss is
    ~1e-8 float noise when every advantage is 0, or on-policy with one micro-batch per generation batch).
    """
    rows = read_jsonl(out / "metrics-composer.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r[channel_key("sdpo")] > 0 and r["composer/sdpo/tokens"] > 0, r
        assert r[channel_key("replay")] > 0 and r["composer/replay/pairs"] > 0, r
        assert r["reward_std"] > 0 and abs(r[channel_key("policy")]) > 1e-6, r
    return rows


def test_composer_train_env_openenv_server_three_channels(tmp_path, openenv_url, capsys) -> None:
    out = tmp_path / "run"
    argv = ["--env", f"openenv:{openenv_url}", "--steps", "3", "--output_dir", str(out), "--no_plot", *SMALL]
    assert main(argv) == 0, capsys.readouterr().err
    rows = _assert_three_channels(out)
    reward_keys = [k for k in rows[0] if k.startswith("rewards/env_reward_openenv")]
    assert reward_keys, sorted(rows[0])  # the reward came from the environment's reward function
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"


def test_composer_train_env_from_yaml_recipe(tmp_path) -> None:
    pytest.importorskip("yaml")
    out = tmp_path / "run"
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(f"env: digit-reversal\nsteps: 3\noutput_dir: {out}\nnum_generations: 8\n")
    assert main(["--config", str(cfg), "--no_plot", "--per_device_train_batch_size", "64"]) == 0
    _assert_three_channels(out)


def test_env_flag_strings_and_yaml_env_var_block(tmp_path, monkeypatch) -> None:
    assert parse(["--env", "openenv:http://127.0.0.1:1"]).recipe.env == "openenv:http://127.0.0.1:1"
    cfg = tmp_path / "r.yaml"
    cfg.write_text("env:\n  COMPOSER_TEST_ENV_VAR: '1'\n")  # TRL's env-var block is still that
    monkeypatch.delenv("COMPOSER_TEST_ENV_VAR", raising=False)
    pytest.importorskip("yaml")
    assert parse(["--config", str(cfg)]).recipe.env is None
    import os

    assert os.environ["COMPOSER_TEST_ENV_VAR"] == "1"
    monkeypatch.delenv("COMPOSER_TEST_ENV_VAR")
    toml = tmp_path / "r.toml"
    toml.write_text('env = "verifiers:my_env"\n')
    assert parse(["--config", str(toml)]).recipe.env == "verifiers:my_env"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--reward_funcs", "m:f"], "--reward_funcs both given"),
        (["--hint_fn", "m:f"], "--hint_fn both given"),
        (["--dataset_name", "x.jsonl"], "--dataset_name both given"),
    ],
)
def test_env_conflicting_flags_exit_2(tmp_path, capsys, extra, needle) -> None:
    assert main(["--env", "digit-reversal", "--output_dir", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_env_bad_spec_exit_2_and_server_down_exit_4(tmp_path, capsys) -> None:
    assert main(["--env", "nope:x", "--output_dir", str(tmp_path / "a"), "--no_plot"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--env 'nope:x'" in err and "openenv" in err and len(err.splitlines()) == 1
    pytest.importorskip("openenv.core", reason="needs composer-core[openenv]")
    from composer_testkit.env_server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["--env", f"openenv:{url}", "--output_dir", str(tmp_path / "b"), "--no_plot"]) == 4
    err = capsys.readouterr().err.strip()
    assert "cannot connect" in err and url in err and len(err.splitlines()) == 1
    assert not (tmp_path / "b").exists()  # nothing written
