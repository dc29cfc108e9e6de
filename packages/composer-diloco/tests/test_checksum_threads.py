"""Checksum threads follow the cores each replica has on its machine (``ObjectStoreAllReduce.checksum_parallel``):
objects name their machine anonymously, replicas count the ones of the last round that share theirs, and replicas
that share 2 cores hash and check in the calling thread (their threads cost more in switching than they overlap)."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from composer_diloco import ObjectStoreAllReduce
from composer_diloco import object_store as osm

N = (16 << 20) // 4  # 16 MiB of float32: above _PARALLEL_BYTES, so the threads are used where allowed


@pytest.fixture
def pool_uses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every time the checksum pool is asked for (the threads are used), one entry."""
    uses: list[int] = []
    real = osm._pool

    def counted() -> Any:
        uses.append(1)
        return real()

    monkeypatch.setattr(osm, "_pool", counted)
    return uses


def _stores(tmp_path: Path, run: str) -> list[ObjectStoreAllReduce]:
    return [
        ObjectStoreAllReduce(f"file://{tmp_path}", run, rank=r, world_size=2, timeout_s=60) for r in range(2)
    ]


@pytest.fixture
def run_round(in_threads: Callable[..., list[Any]]) -> Callable[[list[ObjectStoreAllReduce], int], None]:
    """One round of fresh values, the replicas as threads; checks the average bit for bit."""

    def one(stores: list[ObjectStoreAllReduce], round_id: int) -> None:
        values = [
            torch.randn(N, generator=torch.Generator().manual_seed(10 * round_id + r)) for r in range(2)
        ]
        work = [v.clone() for v in values]
        in_threads(lambda r: stores[r].allreduce(round_id, [work[r]]), 2)
        expected = (values[0] + values[1]) / 2
        assert all(torch.equal(w, expected) for w in work)

    return one


def test_objects_name_their_machine_without_naming_the_host(tmp_path: Path) -> None:
    stores = _stores(tmp_path, "m")
    metas = [s.decode(s.encode(0, [torch.ones(4)]), round_id=0, rank=s.rank).meta for s in stores]
    assert re.fullmatch(r"[0-9a-f]{16}", metas[0]["machine"]) and metas[0]["machine"] == metas[1]["machine"]
    assert socket.gethostname() not in json.dumps(metas[0])
    assert all(s.colocated == 1 and s.checksum_parallel == (osm._usable_cores() >= 2) for s in stores)


def test_replicas_sharing_two_cores_check_in_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool_uses: list[int], run_round: Any
) -> None:
    monkeypatch.setattr(osm, "_usable_cores", lambda: 2)
    stores = _stores(tmp_path, "shared")
    run_round(stores, 0)  # nothing known of the others before the first round: the threads are used
    assert pool_uses and all(s.colocated == 2 and not s.checksum_parallel for s in stores)
    pool_uses.clear()
    run_round(stores, 1)
    assert not pool_uses  # publish and validation both scanned in the calling threads


def test_replicas_with_cores_to_spare_keep_the_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool_uses: list[int], run_round: Any
) -> None:
    monkeypatch.setattr(osm, "_usable_cores", lambda: 4)
    stores = _stores(tmp_path, "spare")
    run_round(stores, 0)
    assert all(s.colocated == 2 and s.checksum_parallel for s in stores)
    pool_uses.clear()
    run_round(stores, 1)
    assert pool_uses


def test_replicas_on_other_machines_do_not_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool_uses: list[int], run_round: Any
) -> None:
    monkeypatch.setattr(osm, "_usable_cores", lambda: 2)
    stores = _stores(tmp_path, "apart")
    stores[1]._machine = "0" * 16  # its objects say they come from another machine
    run_round(stores, 0)
    assert [s.colocated for s in stores] == [1, 1] and all(s.checksum_parallel for s in stores)
    pool_uses.clear()
    run_round(stores, 1)
    assert pool_uses


def test_a_sharded_exchange_counts_its_replicas_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_round: Any
) -> None:
    monkeypatch.setattr(osm, "_usable_cores", lambda: 2)
    stores = [
        ObjectStoreAllReduce(
            f"file://{tmp_path}", "sh", rank=r, world_size=2, timeout_s=60, exchange="sharded"
        )
        for r in range(2)
    ]
    run_round(stores, 0)
    assert all(s.colocated == 2 and not s.checksum_parallel for s in stores)
