"""The serverless invariant under faults, with real replica processes over file:// and s3://
(moto's server on 127.0.0.1): every replica that completes round r applies the same average,
or fails with an error naming why.

Replicas run ``tests/store_replica.py:exchange`` in their own processes. Nothing depends on
timing luck: replicas that must meet in a round start together through a gate file, every wait
is bounded and generous, and a replica that must be absent from a round is simply not started.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from composer_diloco import ObjectStoreAllReduce
from composer_diloco.executors import ReplicaProcess

TESTS = Path(__file__).resolve().parent
TARGET = "store_replica:exchange"
WAIT_S = 240.0  # per replica process: generous, the machine is shared and slow


@dataclass
class Store:
    url: str
    run_id: str
    options: dict[str, Any] = field(default_factory=dict)

    def admin(self, world_size: int) -> ObjectStoreAllReduce:
        """A handle for the test itself (inspecting / damaging the store), never a replica."""
        return ObjectStoreAllReduce(
            self.url, self.run_id, rank=0, world_size=world_size, storage_options=self.options
        )


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "file":
        return Store(f"file://{tmp_path / 'store'}", "run")
    return Store("s3://diloco-test/faults", f"f-{uuid.uuid4().hex[:10]}", request.getfixturevalue("moto_s3"))


def replica_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **(extra or {})}


def start(
    workdir: Path,
    store: Store,
    rank: int,
    world_size: int,
    rounds: list[list[float]],
    env: dict[str, str] | None = None,
    **kw: Any,
) -> ReplicaProcess:
    kwargs = {
        "url": store.url,
        "run_id": store.run_id,
        "rank": rank,
        "world_size": world_size,
        "rounds": rounds,
        "storage_options": store.options,
        **kw,
    }
    return ReplicaProcess(rank, TARGET, kwargs, workdir, replica_env(env))


def finish(proc: ReplicaProcess) -> dict[str, Any]:
    result = proc.finish(WAIT_S)
    assert result.exit_code == 0, result.log_tail
    return result.value  # type: ignore[no-any-return]


def open_gate(procs: list[ReplicaProcess], gate: Path) -> None:
    """Wait (bounded) until every replica is ready, then let them all start round one."""
    deadline = time.monotonic() + WAIT_S
    for p in procs:
        while "ready rank=" not in p.log_text():
            assert p.proc.poll() is None, p.log_text()
            assert time.monotonic() < deadline, f"replica {p.rank} never got ready"
            time.sleep(0.05)
    gate.touch()


def run_together(
    workdir: Path, store: Store, world_size: int, values: dict[int, list[list[float]]], **kw: Any
) -> dict[int, dict[str, Any]]:
    gate = workdir / f"gate-{uuid.uuid4().hex[:6]}"
    procs = [start(workdir, store, r, world_size, rounds, gate=str(gate), **kw) for r, rounds in values.items()]
    open_gate(procs, gate)
    return {p.rank: finish(p) for p in procs}


def test_late_replica_whose_committed_manifest_was_deleted_fails_named(store: Store, tmp_path: Path) -> None:
    done = run_together(tmp_path, store, 3, {0: [[0, 1.0]], 1: [[0, 2.0]]}, on_timeout="proceed", timeout_s=10)
    for out in done.values():
        assert out["error"] is None and out["results"][0]["value"] == 1.5
        assert out["results"][0]["participants"] == [0, 1]
    admin = store.admin(3)
    admin.fs.rm(admin.manifest_key(0))  # a lifecycle rule / an interrupted cleanup
    late = finish(start(tmp_path, store, 2, 3, [[0, 9.0]], on_timeout="proceed", timeout_s=10))
    # before: the late replica proposed a new manifest of its own view and ended with 4.0
    assert late["results"] == [] and late["error"] == "RoundExpiredError", late
    assert "manifest" in late["message"] and "checkpoint" in late["message"]


def test_rerun_of_a_committed_round_adopts_the_committed_average(store: Store, tmp_path: Path) -> None:
    done = run_together(tmp_path, store, 2, {0: [[0, 2.0]], 1: [[0, 4.0]]}, timeout_s=120)
    assert [out["results"][0]["value"] for out in done.values()] == [3.0, 3.0]
    admin = store.admin(2)
    stored = admin.fs.cat_file(admin.object_key(0, 1))
    rerun = finish(start(tmp_path, store, 1, 2, [[0, 22.0]], timeout_s=120))
    # before: the re-run overwrote its object and averaged 2 with 22 -> 12.0
    assert rerun["error"] is None and rerun["results"][0]["value"] == 3.0, rerun
    assert rerun["results"][0]["adopted"] and rerun["results"][0]["participants"] == [0, 1]
    assert admin.fs.cat_file(admin.object_key(0, 1)) == stored  # the committed object is immutable


def test_replica_behind_keep_rounds_gets_round_expired_and_recreates_nothing(
    store: Store, tmp_path: Path
) -> None:
    ahead = finish(
        start(tmp_path, store, 0, 2, [[r, 1.0] for r in range(4)], on_timeout="proceed", timeout_s=1.0)
    )
    assert [r["participants"] for r in ahead["results"]] == [[0]] * 4
    admin = store.admin(2)
    assert admin.rounds_present() == [2, 3]  # keep_rounds=2: rounds 0 and 1 are gone
    late = finish(start(tmp_path, store, 1, 2, [[0, 5.0]], on_timeout="proceed", timeout_s=1.0))
    # before: the late replica averaged alone (5.0), logged a warning and recreated round 0
    assert late["results"] == [] and late["error"] == "RoundExpiredError", late
    assert "keep_rounds=2" in late["message"] and "checkpoint" in late["message"]
    assert admin.rounds_present() == [2, 3]
