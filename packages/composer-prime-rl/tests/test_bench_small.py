"""The bench script runs (CI's check at ``--small``; times are not asserted, benchmarks are scripts), and its
load-independent figure holds: the aten operators one sample's forward + backward dispatches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_composer_loss.py"


def test_bench_runs_at_small_size_and_counts_operators(tmp_path: Path) -> None:
    env = {**os.environ, "COMPOSER_BENCH_OUT": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, str(BENCH), "--small"], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((tmp_path / "bench_composer_loss.json").read_text())
    assert data["machine"] and data["readme"]["rows"]
    (row,) = data["rows"]
    ops = row["ops_per_sample"]
    assert ops["inline_dppo_kl"] == 35
    assert ops["composer_dppo"] <= 48, ops  # 74 before the gradient was written out (one autograd node)
    assert ops["composer_clipped_surrogate_sdpo"] <= 95, ops
