"""The bench script runs (CI's check at ``--small``: 1 and 16 MiB, k = 2 and 4; times are not asserted,
benchmarks are scripts), and its load-independent figures hold: bytes read per replica-round against k."""

from __future__ import annotations

from pathlib import Path

from composer_diloco.object_store import PHASES
from composer_testkit.bench import load_bench_json, run_small_bench

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_diloco.py"


def test_bench_runs_at_small_size_and_sharded_reads_stay_flat(tmp_path: Path) -> None:
    run_small_bench(BENCH, tmp_path, env={"COMPOSER_BENCH_LARGE": "0"}, timeout=900)
    data = load_bench_json(tmp_path / "diloco.json")
    assert {(r["url"], r["megabytes_per_replica"], r["tensors"]) for r in data["throughput"]} == {
        (u, m, 1) for u in ("file", "s3") for m in (1.0, 16.0)
    } | {(u, 1.0, 200) for u in ("file", "s3")}  # 1 MiB again as 200 tensors: the per-tensor cost shows
    assert sum("full, 200 tensors)" in row[0] for row in data["readme"]["rows"]) == 2
    # the replicas of a timed round (and of its raw copy) are two processes of their own, as in training
    for r in data["throughput"]:
        assert len(set(r["replica_pids"])) == 2 and r["bench_pid"] not in r["replica_pids"], r
    # both sides' kernel CPU time (page cache, page faults): where a VM hands freed memory back to the host, a
    # write landing on handed-back pages pays host faults, and the note names that setting from the JSON
    for r in data["throughput"]:
        assert set(r["kernel_s"]) == {"allreduce", "raw_copy"}, r
        assert all(v["min"] >= 0 and v["max"] < 60 for v in r["kernel_s"].values()), r
    reporting = data["machine"]["page_reporting"]
    assert reporting is None or set(reporting) == {"order", "min_free_ms"}, reporting
    assert ("free page reporting" in data["readme"]["note"]) == bool(reporting), data["readme"]["note"]
    # where each round's time went (RoundStats.phases), a column of the README table
    for r in data["throughput"]:
        assert list(r["phases_s"]) == list(PHASES) and all(v["min"] >= 0 for v in r["phases_s"].values())
        assert sum(v["median"] for v in r["phases_s"].values()) <= 2 * r["allreduce_s"]["max"]
    # one replica's publish against a raw write of the same bytes, both measured (README rows)
    assert {(r["url"], r["megabytes_per_replica"]) for r in data["publish"]} == {
        (u, m) for u in ("file", "s3") for m in (1.0, 16.0)
    }
    for r in data["publish"]:
        assert (
            r["publish_s"]["min"] > 0
            and r["raw_write_s"]["min"] > 0
            and r["ratio_publish_over_raw_write"]["min"] > 0
        )
    assert sum("publish vs raw fsspec write" in row[0] for row in data["readme"]["rows"]) == 4
    reads = {(r["k"], r["exchange"]): r["read_over_payload"]["median"] for r in data["scaling"]}
    assert abs(reads[(4, "sharded")] - 1.5) < 0.01 and abs(reads[(4, "full")] - 3.0) < 0.01, reads
