"""The bench script runs (CI's check at ``--small``; times are not asserted, benchmarks are scripts): every
trainer, the extra forwards and the reward comparison, and both sides of that comparison start from the same
rewards (same seed, same model, same first rollout)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from composer_testkit.bench import load_bench_json, run_bench, run_small_bench

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_trl.py"


def test_bench_runs_at_small_size(tmp_path: Path) -> None:
    run_small_bench(BENCH, tmp_path)
    data = load_bench_json(tmp_path / "bench_trl.json")
    assert len(data["readme"]["rows"]) == 4
    assert data["small"] is True
    assert {k: len(v["runs"]) for k, v in data["step_seconds"].items()} == {
        "grpo": data["repeats"],
        "composer-off": data["repeats"],
        "composer-on": data["repeats"],
    }
    assert set(data["extras_alone_seconds"]) == {"teacher_forward", "pair_forward_backward"}
    reward = data["reward"]
    assert data["readme"]["note"].startswith(f"Reward after {data['reward_steps']} steps (same seed")
    assert reward["composer"]["reward_first"] == pytest.approx(reward["grpo"]["reward_first"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: --device cuda would run")
def test_bench_device_cuda_without_a_gpu_exits_2_in_one_line(tmp_path: Path) -> None:
    res = run_bench(BENCH, tmp_path, "--small", "--device", "cuda")
    assert res.returncode == 2, res.stderr
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .endswith("--device cuda: torch sees no CUDA device (run without --device for the CPU bench)")
    )
    assert not any(tmp_path.iterdir())


def test_dtype_bench_runs_at_small_size(tmp_path: Path) -> None:
    """bench_dtype.py: every (run, dtype) cell ran, and the README rows are the medians it measured."""
    run_small_bench(BENCH.with_name("bench_dtype.py"), tmp_path)
    data = load_bench_json(tmp_path / "bench_dtype.json")
    assert data["small"] is True
    med = data["median_seconds_per_step"]
    assert set(med) == {"grpo", "sdpo (success)"}
    for row in data["readme"]["rows"]:
        m = med[row[0]]
        assert row[1:] == [round(m["float32"], 2), round(m["bf16"], 2), round(m["bf16"] / m["float32"], 3)]
