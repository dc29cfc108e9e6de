"""`composer-train --env verifiers:<module>`: a verifiers environment drives a run whose three channels train.

The environment is composer-core's fixture package (tests/fixtures/composer-vf-digits, installed by the nox
session): a verifiers 0.4 taskset whose ``@vf.reward`` is the digit-reversal verifier and writes its feedback to
``trace.info["feedback"]``; composer-core's verifiers adapter turns that into TRL reward / hint functions.
"""

from __future__ import annotations

import json

from composer_trl.cli import main
from composer_trl.progress import read_jsonl

KEYS = {
    "policy": "composer/loss/policy",
    "sdpo": "composer/loss/sdpo",
    "replay": "composer/loss/replay",
    "sdpo_tokens": "composer/sdpo/tokens",
    "replay_pairs": "composer/replay/pairs",
}
"""The logged metric keys this test reads (the one place to change when the keys move, e.g. composer/loss/sdpo)."""


SMALL = ["--per_device_train_batch_size", "64", "--num_generations", "8", "--max_completion_length", "3"]


def test_composer_train_env_verifiers_three_channels(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    argv = [
        "--env",
        "verifiers:composer_vf_digits",
        "--steps",
        "3",
        "--output_dir",
        str(out),
        "--no_plot",
        *SMALL,
    ]
    assert main(argv) == 0, capsys.readouterr().err
    rows = read_jsonl(out / "metrics-composer.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # sdpo / replay: losses > 0 with hinted tokens and pairs; policy: GRPO's on-policy loss value is ~0 by
        # construction when every advantage is 0: rewards within a step differ and |loss| > 1e-6
        assert r[KEYS["sdpo"]] > 0 and r[KEYS["sdpo_tokens"]] > 0, r
        assert r[KEYS["replay"]] > 0 and r[KEYS["replay_pairs"]] > 0, r
        assert r["reward_std"] > 0 and abs(r[KEYS["policy"]]) > 1e-6, r
    assert any(k.startswith("rewards/env_reward_verifiers_composer_vf_digits") for k in rows[0]), sorted(
        rows[0]
    )
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"


def test_composer_train_env_verifiers_unknown_module_exit_2(tmp_path, capsys) -> None:
    assert main(["--env", "verifiers:no_such_vf_env", "--output_dir", str(tmp_path / "o"), "--no_plot"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no_such_vf_env" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()
