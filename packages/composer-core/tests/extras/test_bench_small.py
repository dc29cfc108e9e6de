"""The bench scripts run (CI's check at ``--small``; times are not asserted, benchmarks are scripts), and their
load-independent figures hold: TRL and Liger-Kernel agree with composer's JSD in value and gradient, and in
the distributed bypass part each rank holds less as k grows in the owned mode and everything in the full one.

bench_jsd.py needs the ``bench`` extra (trl, liger-kernel); a missing peer fails its child process, so the
test fails rather than skips. bench_bypass.py plots with matplotlib (the ``plot`` extra, part of ``all``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from composer_testkit.bench import load_bench_json, run_small_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_bench_jsd_runs_at_small_size_and_the_peers_agree(tmp_path: Path) -> None:
    """With ``--compiled-kernel`` (CUDA's default; here inductor's CPU backend compiles it, which needs a C++
    compiler) composer with ``compiled=True`` is one more method of both forms, checked against composer's
    eager kernel like the peers."""
    compiled = shutil.which(os.environ.get("CXX", "c++")) is not None
    run_small_bench(
        BENCH / "bench_jsd.py", tmp_path, args=["--compiled-kernel" if compiled else "--no-compiled-kernel"]
    )
    data = load_bench_json(tmp_path / "bench_jsd.json")
    assert data["config"]["small"] is True and data["config"]["compiled_kernel"] is compiled
    assert data["complete"] is True  # rewritten after every row with False until the last one
    more = {"composer_compiled"} if compiled else set()
    methods = {
        "fused": {"composer", "trl", "liger", "floor"} | more,
        "logits": {"composer", "trl", "liger"} | more,
    }
    peers = {"fused": {"trl", "liger"} | more, "logits": {"trl", "liger"} | more}
    assert {row["form"] for row in data["rows"]} == set(methods)
    assert (data["readme"]["columns"][-1] == "compiled memory / Liger") is compiled
    for row in data["rows"]:
        assert set(row["methods"]) == methods[row["form"]], row["form"]
        assert set(row["agreement"]) == peers[row["form"]], row["form"]
        for peer, agree in row["agreement"].items():
            assert agree["loss_rel"] < 1e-4 and agree["grad_rel"] < 1e-3, (row["form"], peer, agree)
        if compiled:
            want = {"trl", "liger"} | ({"floor"} if row["form"] == "fused" else set())
            assert {k for k in row["ratios"] if k.startswith("compiled_time_vs_")} == {
                f"compiled_time_vs_{m}" for m in want
            }


def test_bench_bypass_runs_at_small_size_and_owned_ranks_hold_less(tmp_path: Path) -> None:
    run_small_bench(BENCH / "bench_bypass.py", tmp_path)
    single = load_bench_json(tmp_path / "bench_bypass.json")
    assert single["small"] is True and set(single["results"]) == {"bypass", "kl"}
    dist = load_bench_json(tmp_path / "bench_bypass_dist.json")
    assert dist["small"] is True and len(dist["readme"]["rows"]) == 7
    held = {key: r["max_model_mib"] for key, r in dist["results"].items()}
    assert set(held) == {f"{mode} k={k}" for mode in ("owned", "full") for k in (1, 2, 4)} | {"kl k=1"}
    assert held["owned k=1"] > held["owned k=2"] > held["owned k=4"], held
    assert held["full k=1"] == held["full k=2"] == held["full k=4"] > held["owned k=1"], held
    ideal = dist["flop_model"]["ideal_speedup_vs_kl"]
    assert ideal["1"] > 1 and ideal["2"] >= ideal["1"], (
        ideal
    )  # KL also runs the LM head; k = 2 splits the blocks
    assert (tmp_path / "bench_bypass_dist.png").stat().st_size > 0
