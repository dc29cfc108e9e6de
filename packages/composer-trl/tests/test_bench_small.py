"""The bench script runs (CI's check at ``--small``; times are not asserted, benchmarks are scripts): every
trainer, the extra forwards and the reward comparison, and both sides of that comparison start from the same
rewards (same seed, same model, same first rollout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_trl.py"


def test_bench_runs_at_small_size(tmp_path: Path) -> None:
    env = {**os.environ, "COMPOSER_BENCH_OUT": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, str(BENCH), "--small"], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((tmp_path / "bench_trl.json").read_text())
    assert data["machine"] and len(data["readme"]["rows"]) == 4
    assert data["small"] is True
    assert {k: len(v["runs"]) for k, v in data["step_seconds"].items()} == {
        "grpo": data["repeats"],
        "composer-off": data["repeats"],
        "composer-on": data["repeats"],
    }
    assert set(data["extras_alone_seconds"]) == {"teacher_forward", "pair_forward_backward"}
    reward = data["reward"]
    assert reward["composer"]["reward_first"] == pytest.approx(reward["grpo"]["reward_first"])
