"""The bench script runs (CI's check at ``--small``; times are not asserted, benchmarks are scripts), and its
load-independent figure holds: the aten operators one sample's forward + backward dispatches."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from composer_testkit.bench import load_bench_json, run_bench, run_small_bench

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_composer_loss.py"


def _bench_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_composer_loss", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bench_runs_at_small_size_and_counts_operators(tmp_path: Path) -> None:
    run_small_bench(BENCH, tmp_path)
    data = load_bench_json(tmp_path / "bench_composer_loss.json")
    ops = {row["layout"]: row["ops_per_sample"] for row in data["rows"]}
    assert ops.keys() == {"packed", "packed_rl_weights", "separate"}
    # each composer configuration is compared with the inline formula of the same loss (information-matched)
    for row in data["rows"]:
        assert "composer_dppo_ratio_vs_inline_dppo_kl" in row
        assert "composer_clipped_surrogate_sdpo_ratio_vs_inline_clipped_sdpo" in row
        assert "composer_clipped_surrogate_sdpo_ratio_vs_inline_dppo_kl" not in row
    # issue 63: every ratio also measured beside a CPU-bound neighbour the bench starts and stops itself, and the
    # cost of reading the typed options per call beside the call's own
    for row in data["rows"]:
        loaded = row["loaded"]
        assert loaded["neighbour"]["started"] and loaded["neighbour"]["stopped"], loaded
        assert loaded["composer_dppo_ratio_vs_inline_dppo_kl"] > 0
        assert loaded["composer_clipped_surrogate_sdpo_ratio_vs_inline_clipped_sdpo"] > 0
        for name in ("composer_dppo", "composer_clipped_surrogate_sdpo"):
            assert 0 < row["options_us_per_call"][name] < row[f"{name}_ms"] * 1e3 / row["samples"], row
    assert "ratio vs inline, loaded" in data["readme"]["columns"]
    # the step's own operators are not counted (a loss that does nothing is subtracted)
    assert ops["packed"]["inline_dppo_kl"] == 32.5 and ops["separate"]["inline_dppo_kl"] == 33.75
    assert ops["packed_rl_weights"]["inline_dppo_kl"] == 34.5  # and the loss weights' product
    # an rl weight stream (a fresh mask per sample, packed float fields): the shared work still runs once per
    # micro-batch, each call masking its rows (45.5 and 96.5 before: every call took the separate path)
    assert ops["packed_rl_weights"]["composer_dppo"] <= 26.5, ops
    assert ops["packed_rl_weights"]["composer_clipped_surrogate_sdpo"] <= 48, ops
    # packed (PRIME-RL's train loop, 4 samples here): the per-token work runs once per micro-batch and each
    # sample costs one matmul over its slice; before it all ran per sample (37.5 and 83.5)
    assert ops["packed"]["composer_dppo"] <= 23, ops
    assert ops["packed"]["composer_clipped_surrogate_sdpo"] <= 40, ops
    # separate tensors: everything per sample (74 before the gradient was written out; 48 before the CPU
    # check read the masked total, the metrics took their means from the sums, and where() got a cached zero;
    # 38.75 and 84.75 before the metric table was written column by column, one pass each on a packed batch)
    assert ops["separate"]["composer_dppo"] <= 45, ops
    assert ops["separate"]["composer_clipped_surrogate_sdpo"] <= 93, ops


@pytest.mark.parametrize("layout", ["packed", "packed_rl_weights", "separate"])
def test_bench_agreement_check_passes_and_catches_a_different_formula(layout: str) -> None:
    """The bench's anchors compute the same loss as composer's configurations (value and gradient), and the check
    that says so fails when an anchor's formula differs (here its clip range or SDPO weight cap)."""
    bench = _bench_module()
    samples = bench.make_samples(4, 64, torch.device("cpu"))
    views, rl_weights = bench.LAYOUTS[layout]
    packed = bench.pack(samples) if views else None
    methods: dict[str, Any] = {
        "inline_dppo_kl": (bench.inline_dppo_kl, {}),
        "inline_clipped_sdpo": (bench.inline_clipped_sdpo, {}),
        "composer_dppo": (bench.composer_loss, {}),
        "composer_clipped_surrogate_sdpo": (
            bench.composer_loss,
            {"policy_loss": "clipped_surrogate", "alpha_sdpo": 1.0},
        ),
    }
    bench.check_agreement(methods, samples, packed, rl_weights)
    for wrong in ({"epsilon": 0.25}, {"token_clip": 3.0}):
        with pytest.raises(
            SystemExit, match="composer_clipped_surrogate_sdpo and inline_clipped_sdpo disagree"
        ):
            bench.check_agreement(
                {**methods, "inline_clipped_sdpo": (bench.inline_clipped_sdpo, wrong)},
                samples,
                packed,
                rl_weights,
            )
    with pytest.raises(SystemExit, match="composer_dppo and inline_dppo_kl disagree"):
        bench.check_agreement(
            {**methods, "inline_dppo_kl": (bench.inline_dppo_kl, {"kl_tau": 0.1})},
            samples,
            packed,
            rl_weights,
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: --device cuda would run")
def test_bench_device_cuda_without_a_gpu_exits_2_in_one_line(tmp_path: Path) -> None:
    res = run_bench(BENCH, tmp_path, "--small", "--device", "cuda")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1].endswith("--device cuda: torch sees no CUDA device here")
    assert not any(tmp_path.iterdir())
