"""The bench script runs (CI's check at ``--small``; times are not asserted, benchmarks are scripts), and its
load-independent figure holds: the aten operators one sample's forward + backward dispatches."""

from __future__ import annotations

from pathlib import Path

from composer_core.testing.bench import load_bench_json, run_small_bench

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_composer_loss.py"


def test_bench_runs_at_small_size_and_counts_operators(tmp_path: Path) -> None:
    run_small_bench(BENCH, tmp_path)
    data = load_bench_json(tmp_path / "bench_composer_loss.json")
    ops = {row["layout"]: row["ops_per_sample"] for row in data["rows"]}
    assert ops.keys() == {"packed", "packed_rl_weights", "separate"}
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
