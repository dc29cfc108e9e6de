"""The sharded exchange (``exchange="sharded"``: reduce-scatter + all-gather through the store) and
the per-replica costs of both exchanges: bytes read per round through an instrumented filesystem,
peak memory, results bit-identical across replicas and equal to the mean computed directly.

Real replica processes (``tests/store_replica.py:random_rounds``) over file://; a few thread-level
checks over file://, memory:// and s3:// (moto on 127.0.0.1). Payloads are small (256 KiB) so that
the whole file adds little to the session's time.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from composer_diloco import CorruptObjectError, NonFiniteResultError, ObjectStoreAllReduce
from composer_diloco.executors import ReplicaProcess

TESTS = Path(__file__).resolve().parent
WAIT_S = 240.0  # per replica process: generous, the machine is shared and slow
NUMEL = 2**16  # 256 KiB of float32 per replica
READ_BOUND = 2.5  # bytes read per replica per round, in payloads (issue 19)


def _direct_mean(
    world: int, round_id: int, ranks: list[int] | None = None, numel: int = NUMEL
) -> torch.Tensor:
    ranks = list(range(world)) if ranks is None else ranks
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(1000 * round_id + r)) for r in ranks]
    acc = xs[0].clone()
    for x in xs[1:]:
        acc += x
    return acc / len(xs)


def replica_env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)}


def open_gate(procs: list[ReplicaProcess], gate: Path) -> None:
    """Wait (bounded) until every replica is ready, then let them all start round one."""
    deadline = time.monotonic() + WAIT_S
    for p in procs:
        while "ready rank=" not in p.log_text():
            assert p.proc.poll() is None, p.log_text()
            assert time.monotonic() < deadline, f"replica {p.rank} never got ready"
            time.sleep(0.05)
    gate.touch()


def finish(proc: ReplicaProcess) -> dict[str, Any]:
    result = proc.finish(WAIT_S)
    assert result.exit_code == 0, result.log_tail
    return result.value  # type: ignore[no-any-return]


def _start(tmp_path: Path, world: int, exchange: str, die: set[int], **kw: Any) -> list[ReplicaProcess]:
    """``world`` replica processes running ``random_rounds``; they begin round 0 together."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    gate = tmp_path / f"gate-{uuid.uuid4().hex[:6]}"
    common = {
        "url": kw.pop("url", f"file://{tmp_path / 'store'}"),
        "run_id": f"{exchange}-{uuid.uuid4().hex[:6]}",
        "gate": str(gate),
    }
    procs = [
        ReplicaProcess(
            r,
            "store_replica:random_rounds",
            {
                **common,
                "rank": r,
                "world_size": world,
                "exchange": exchange,
                "die_before_reduce": r in die,
                **kw,
            },
            tmp_path,
            replica_env(),
        )
        for r in range(world)
    ]
    open_gate(procs, gate)
    return procs


def _run(tmp_path: Path, world: int, exchange: str, rounds: int = 2, **kw: Any) -> dict[int, dict[str, Any]]:
    die = kw.pop("die", set())
    procs = _start(tmp_path, world, exchange, die, rounds=rounds, numel=kw.pop("numel", NUMEL), **kw)
    out: dict[int, dict[str, Any]] = {}
    for p in procs:
        if p.rank in die:
            result = p.finish(WAIT_S)
            assert result.exit_code == -9, result.log_tail  # SIGKILLed itself before reducing
        else:
            out[p.rank] = finish(p)
    return out


@pytest.mark.parametrize(("world", "numel"), [(2, 4 * 2**20), (4, NUMEL)])
def test_sharded_reads_at_most_2_5_payloads_identical_and_exact(
    tmp_path: Path, world: int, numel: int
) -> None:
    """k = 2 at 16 MiB also bounds peak memory (RSS growth over the rounds, an upper bound)."""
    sharded = _run(tmp_path, world, "sharded", numel=numel)
    payload = sharded[0]["payload"]
    for round_id in range(2):
        expected = _direct_mean(world, round_id, numel=numel)
        values = [sharded[r]["rounds"][round_id]["value"] for r in range(world)]
        for v in values:  # bit-identical across replicas, equal to the directly computed mean
            assert torch.equal(v, values[0])
        assert torch.equal(values[0], expected)
        reads = [sharded[r]["rounds"][round_id]["read"] / payload for r in range(world)]
        assert max(reads) <= READ_BOUND, reads
        assert min(reads) >= 2 * (world - 1) / world * 0.99, reads  # it did read the other shards
    if world == 2:
        for rank, res in sharded.items():
            assert res["peak_rss_growth"] <= 2.5 * payload, (rank, res["peak_rss_growth"] / payload)


def test_dead_reducer_shard_is_taken_over_then_the_run_goes_on_without_it(tmp_path: Path) -> None:
    """Rank 1 publishes its shards, is committed in round 0's manifest, and is SIGKILLed when it
    starts reducing its shard. After timeout_s the survivors reduce shard 1 themselves (first
    writer wins; all apply the stored shard). Round 1 proceeds without rank 1: 2 participants
    reduce 3 shards."""
    out = _run(tmp_path, 3, "sharded", timeout_s=3.0, on_timeout="proceed", die={1})
    assert sorted(out) == [0, 2]
    r0 = [out[r]["rounds"][0] for r in (0, 2)]
    assert all(x["participants"] == [0, 1, 2] for x in r0)
    assert torch.equal(r0[0]["value"], r0[1]["value"])
    assert torch.equal(r0[0]["value"], _direct_mean(3, 0))
    r1 = [out[r]["rounds"][1] for r in (0, 2)]
    assert all(x["participants"] == [0, 2] for x in r1)
    assert torch.equal(r1[0]["value"], r1[1]["value"])
    assert torch.equal(r1[0]["value"], _direct_mean(3, 1, [0, 2]))


@pytest.mark.parametrize(
    ("store", "mib", "bound"), [("file", 16, 2.5), ("s3", 64, 3.0)], ids=["file-16MiB", "s3-64MiB"]
)
def test_full_exchange_peak_memory(
    tmp_path: Path, request: pytest.FixtureRequest, store: str, mib: int, bound: float
) -> None:
    """Per replica, each of 3 rounds' peak RSS above that round's start, in payloads, and what is still resident
    after the rounds once the allocator has given back its free chunks (``malloc_trim``). file://: issue 19's 2.5
    (16 MiB is large enough that the growth is the exchange's, not noise; measured 1.0-1.27). s3:// (moto), 64
    MiB, a LoRA adapter's or a small model's size: each object goes up as one joined ``bytes`` (botocore streams
    it; a ``bytearray`` kept across rounds was copied three more times by aiohttp: 4.1-5.0 payloads); a round
    holds the PUT's body and the copy aiohttp makes to size it (publish), then the peer's GET read as chunks and
    joined (commit): measured 2.00-2.06, quiet or beside two CPU-bound processes. The peak over the whole run is
    not bounded: under load glibc spreads the GET's chunks over more arenas and keeps them, so the RSS between
    rounds grew by up to one payload per round (4.01 over 3 rounds) with no object holding it; after
    ``malloc_trim`` at most one payload stays (measured -0.07-1.09), where a leak of each round's object would
    leave three."""
    numel = mib * 2**18
    where: dict[str, Any] = {}
    if store == "s3":
        where = {
            "url": f"s3://diloco-test/peak-{uuid.uuid4().hex[:6]}",
            "storage_options": request.getfixturevalue("moto_s3"),
        }
    for rank, res in _run(tmp_path, 2, "full", rounds=3, numel=numel, **where).items():
        per_round = [r["peak_growth"] / res["payload"] for r in res["rounds"]]
        assert max(per_round) <= bound, (rank, per_round)
        assert res["live_after"] / res["payload"] <= 1.5, (rank, res["live_after"] / res["payload"])
        assert torch.equal(res["rounds"][2]["value"], _direct_mean(2, 2, numel=numel))


def _threads(
    stores: list[ObjectStoreAllReduce], round_id: int, values: list[list[torch.Tensor]], **kw: Any
) -> list[Any]:
    """Every store's ``allreduce(round_id, values[i], **kw)`` in its own thread: each result or exception."""
    out: list[Any] = [None] * len(stores)

    def go(i: int) -> None:
        try:
            out[i] = stores[i].allreduce(round_id, values[i], **kw)
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.fixture(params=["file", "memory", "s3"])
def any_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any] | None]:
    if request.param == "file":
        return f"file://{tmp_path}", None
    if request.param == "memory":
        return f"memory://sh-{uuid.uuid4().hex}", None
    return f"s3://diloco-test/sh-{uuid.uuid4().hex[:8]}", request.getfixturevalue("moto_s3")


def test_sharded_equals_full_bit_for_bit_with_mixed_dtypes_and_fp8(any_url: tuple[str, Any]) -> None:
    url, options = any_url

    def values(r: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(r)
        return [
            torch.randn(5, 7, generator=g),
            torch.randn(3, generator=g).bfloat16(),
            torch.randn(1, generator=g),
        ]

    for quantize in (False, True):
        got = {}
        for mode in ("full", "sharded"):
            stores = [
                ObjectStoreAllReduce(
                    url,
                    f"{mode}{int(quantize)}",
                    rank=r,
                    world_size=3,
                    storage_options=options,
                    exchange=mode,
                )
                for r in range(3)
            ]
            vals = [values(r) for r in range(3)]
            stats = _threads(stores, 0, vals, quantize=quantize)
            assert all(not isinstance(s, BaseException) for s in stats), stats
            for v in vals[1:]:
                assert all(torch.equal(a, b) for a, b in zip(v, vals[0]))
            got[mode] = vals[0]
            read = max(st.bytes_read for st in stats)
            payload = sum(t.numel() * t.element_size() for t in vals[0])
            assert read > 1.9 * payload if mode == "full" else True  # k=3: full reads 2 whole objects
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got["full"], got["sharded"]))


def test_sharded_rerun_of_a_committed_round_adopts_and_straggler_adopts(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    stores = [
        ObjectStoreAllReduce(
            url, "run", rank=r, world_size=3, timeout_s=0.5, on_timeout="proceed", exchange="sharded"
        )
        for r in range(3)
    ]
    vals = [[torch.full((10,), float(r))] for r in range(2)]
    stats = _threads(stores[:2], 0, vals)
    assert all(s.participants == [0, 1] for s in stats) and torch.equal(vals[0][0], torch.full((10,), 0.5))
    late = [torch.full((10,), 100.0)]  # the straggler adopts the committed average
    assert stores[2].allreduce(0, late).adopted and torch.equal(late[0], torch.full((10,), 0.5))
    again = [torch.full((10,), 7.0)]  # a re-run with new values adopts too
    assert stores[0].allreduce(0, again).adopted and torch.equal(again[0], torch.full((10,), 0.5))


def test_mixing_exchanges_in_one_run_is_refused_by_name(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    full = ObjectStoreAllReduce(url, "run", rank=0, world_size=2, timeout_s=0.5)
    sharded = ObjectStoreAllReduce(url, "run", rank=1, world_size=2, timeout_s=0.5, exchange="sharded")
    out = _threads([full, sharded], 0, [[torch.ones(4)], [torch.ones(4)]])
    assert all(isinstance(e, CorruptObjectError) and "exchange=" in str(e) for e in out), out
    with pytest.raises(ValueError, match="exchange must be"):
        ObjectStoreAllReduce(url, "run", rank=0, world_size=2, exchange="ring")  # type: ignore[arg-type]


def _overflowing(r: int) -> list[torch.Tensor]:
    """Rank ``r``'s tensors for the overflow tests: finite values whose float32 sum over 3 ranks overflows only in
    shard 0 of 3 (the first third of each tensor): in tensor 0 at the start of its first piece on the piecewise
    path and at the start of its second, in the bfloat16 tensor 1 at its largest value; ordinary values elsewhere.
    One reducer's shard overflows and the others do not."""
    from composer_diloco.object_store.reduce import REDUCE_PIECE as _REDUCE_PIECE

    g = torch.Generator().manual_seed(r)
    first = torch.randn(3 * _REDUCE_PIECE + 12, generator=g)  # shard 0 reaches past the first piece
    first[:4] = 3e38
    first[_REDUCE_PIECE + 2] = -3e38
    second = torch.randn(6, generator=g).bfloat16()
    second[:2] = torch.finfo(torch.bfloat16).max
    return [first, second]


def _stores(url: str, exchange: str, world: int = 3) -> list[ObjectStoreAllReduce]:
    run = f"{exchange}-{uuid.uuid4().hex[:6]}"
    return [
        ObjectStoreAllReduce(url, run, rank=r, world_size=world, timeout_s=20, exchange=exchange)
        for r in range(world)
    ]


@pytest.mark.parametrize("exchange", ["full", "sharded"])
def test_an_average_whose_float32_sum_overflows_is_the_true_average_on_every_replica(exchange: str) -> None:
    """Finite contributions whose float32 running sum overflows (3 x 3e38): the average itself is finite, and every
    replica ends the round with it, identical, by both exchanges; elements whose sum does not overflow keep the
    float32 arithmetic (Σ in rank order, then / n). On 52831fd the full exchange wrote inf into every replica
    without an error, and in the sharded exchange the reducer of the overflowing shard applied inf while the
    other replicas raised: replicas left the round with different weights."""
    stores = _stores(f"memory://ovf-{uuid.uuid4().hex}", exchange)
    values = [_overflowing(r) for r in range(3)]
    out = _threads(stores, 0, values)
    assert all(not isinstance(o, BaseException) for o in out), out
    inputs = [_overflowing(r) for r in range(3)]
    # Σ in rank order in float32, then / 3, in each tensor's dtype: inf where the float32 sum overflows
    expect = [(sum(x[i].float() for x in inputs) / 3).to(inputs[0][i].dtype) for i in range(2)]
    assert [int(e.isinf().sum()) for e in expect] == [5, 2]
    for e, x in zip(expect, inputs[0], strict=True):
        e[e.isinf()] = x[e.isinf()]  # ±3e38 and bfloat16's largest value are their own means
    for v in values:
        assert all(torch.isfinite(t.float()).all() for t in v)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(v, expect, strict=True)), v


@pytest.mark.parametrize("exchange", ["full", "sharded"])
def test_a_sum_that_overflows_float32_is_refused_on_every_replica_with_nothing_changed(exchange: str) -> None:
    """``op="sum"`` whose result is beyond float32 (3 x 3e38) cannot be applied: every replica raises
    NonFiniteResultError naming the tensor or shard and the fix, and no tensor changes, promptly (not after a
    reducer's timeout). On 52831fd the full exchange wrote inf into every replica without an error, and the
    sharded reducer of the overflowing shard applied it while its readers raised."""
    stores = _stores(f"memory://ovf-{uuid.uuid4().hex}", exchange)
    values = [_overflowing(r) for r in range(3)]
    start = time.monotonic()
    out = _threads(stores, 0, values, op="sum")
    assert all(isinstance(o, NonFiniteResultError) for o in out), out
    assert all("overflows float32" in str(o) and "op='sum'" in str(o) for o in out), out
    assert time.monotonic() - start < 10
    for r, v in enumerate(values):
        assert all(torch.equal(a, b) for a, b in zip(v, _overflowing(r), strict=True))
    scaled = [[t * 1e-30 for t in v] for v in values]  # the fix the message names: the run goes on
    stats = _threads(stores, 1, scaled)
    assert all(not isinstance(s, BaseException) and s.participants == [0, 1, 2] for s in stats), stats
    assert all(torch.equal(a, b) for v in scaled[1:] for a, b in zip(v, scaled[0], strict=True))


@pytest.mark.parametrize("exchange", ["full", "sharded"])
def test_float64_values_beyond_float32_are_refused_on_every_replica_not_averaged_to_inf(
    exchange: str,
) -> None:
    """The exchange averages in float32: float64 values beyond its range (1e300) have no float32 average. Every
    replica raises NonFiniteResultError naming the fix and keeps its tensors; on 52831fd the full exchange wrote
    inf into every replica without an error."""
    stores = _stores(f"memory://ovf-{uuid.uuid4().hex}", exchange, world=2)
    values = [[torch.full((6,), 1e300, dtype=torch.float64)] for _ in range(2)]
    out = _threads(stores, 0, values)
    assert all(isinstance(o, NonFiniteResultError) and "float32's range" in str(o) for o in out), out
    assert all(torch.equal(v[0], torch.full((6,), 1e300, dtype=torch.float64)) for v in values)


def _many(r: int) -> list[torch.Tensor]:
    """Rank ``r``'s tensors for the many-tensor test: an empty one, then 150 small float32 ones (averaged several
    at a time on the full exchange's direct path), one whose float32 sum over 3 ranks overflows at two elements,
    one larger than a bucket's tensor (the piecewise path), a bfloat16 one and a 2-D one."""
    g = torch.Generator().manual_seed(r)
    sizes = torch.randint(1, 3000, (150,), generator=torch.Generator().manual_seed(99)).tolist()
    ts = [torch.randn(n, generator=g) for n in sizes]
    ts[3][:2] = 3e38
    ts.insert(0, torch.zeros(0))  # an empty one first
    ts.insert(10, torch.randn(40_000, generator=g))
    ts.insert(20, torch.randn(8, generator=g).bfloat16())
    ts.append(torch.randn(4, 4, generator=g))
    return ts


def test_many_small_tensors_average_bit_for_bit_as_one_at_a_time() -> None:
    """The full exchange averages small float32 targets several at a time (gathered, summed, mended, divided,
    scattered back); the sharded exchange and the formula do it tensor by tensor: the same bits on every replica,
    the overflowing elements mended to the true average."""
    inputs = [_many(r) for r in range(3)]
    got = {}
    for exchange in ("full", "sharded"):
        values = [_many(r) for r in range(3)]
        out = _threads(_stores(f"memory://many-{uuid.uuid4().hex}", exchange), 0, values)
        assert all(not isinstance(o, BaseException) for o in out), out
        for v in values[1:]:
            assert all(torch.equal(a, b) for a, b in zip(v, values[0], strict=True))
        got[exchange] = values[0]
    expect = [(sum(x[i].float() for x in inputs) / 3).to(inputs[0][i].dtype) for i in range(len(inputs[0]))]
    assert int(expect[4].isinf().sum()) == 2
    expect[4][:2] = 3e38
    for a, b, e in zip(got["full"], got["sharded"], expect, strict=True):
        assert torch.equal(a, e) and torch.equal(b, e) and a.dtype == e.dtype and a.shape == e.shape
