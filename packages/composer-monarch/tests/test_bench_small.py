"""The bench scripts run (CI's check at ``--small``; times are not asserted, benchmarks are scripts), and their
load-independent figures hold: the overlap bench's ideal ratio is at least 1, and every weight push delivers the
trainer's fp32 weights (checked bit-exact by the script) with ``auto`` picking shared memory on one host."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from composer_testkit.bench import load_bench_json, run_small_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _run(script: str, out: Path) -> dict[str, Any]:
    run_small_bench(BENCH / f"{script}.py", out)
    data = load_bench_json(out / f"{script}.json")
    assert data["small"] is True
    return data


def test_bench_overlap_runs_at_small_size(tmp_path: Path) -> None:
    data = _run("bench_monarch", tmp_path)
    assert {m: len(ts) for m, ts in data["seconds"].items()} == {
        "sequential": data["reps"],
        "overlap": data["reps"],
    }
    assert len(data["readme"]["rows"]) == 2
    assert set(data["sequential_phase_median_s"]) == {"train_wait_s", "push_s", "rollout_s"}
    assert data["ideal_ratio_from_phases"] >= 1.0  # (train + push + rollout) / (max(train, rollout) + push)
    assert data["parallel_capacity_2_procs"] > 0
    plotted = (tmp_path / "bench_monarch.png").exists()
    assert plotted == (importlib.util.find_spec("matplotlib") is not None)  # the plot is optional there


def test_bench_push_runs_at_small_size_and_moves_the_weights(tmp_path: Path) -> None:
    data = _run("bench_monarch_push", tmp_path)
    methods = ("driver-pickle", "shm", "rdma", "direct")
    assert {m: len(ts) for m, ts in data["seconds"].items()} == {m: data["reps"] for m in methods}
    assert data["checked_bit_exact"] is True  # every push compared bit for bit on both receivers
    assert data["bytes_per_receiver"] == 4 * data["params"]  # fp32, no padding at these shapes
    assert data["auto_transport_here"] == "shm"  # every actor on this host
