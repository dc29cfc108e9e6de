"""ObjectStoreAllReduce over real fsspec filesystems (file://, memory://; s3:// in test_serverless):
atomic rounds, manifests, cleanup, stragglers, corrupt/partial objects, key escapes, rank checks."""

from __future__ import annotations

import json
import pickle
import threading
import time
import types
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from composer_diloco import (
    AuthenticationError,
    CorruptObjectError,
    NonFiniteObjectError,
    ObjectStoreAllReduce,
    ObjectStoreError,
    RoundConflictError,
    RoundExpiredError,
    RoundWithdrawnError,
    StragglerTimeoutError,
    dequantize_fp8,
    quantize_fp8,
)
from composer_diloco.object_store.errors import safe_part


def _encode(store: ObjectStoreAllReduce, round_id: int, tensors: list[torch.Tensor]) -> bytes:
    """The object ``store`` publishes for ``tensors`` in ``round_id``, as bytes."""
    return store._encode(round_id, tensors, False)[0].tobytes()


def _stores(url: str, world: int, **kw: Any) -> list[ObjectStoreAllReduce]:
    return [ObjectStoreAllReduce(url, "run", rank=r, world_size=world, **kw) for r in range(world)]


def _parallel(
    stores: list[ObjectStoreAllReduce], round_id: int, values: list[list[torch.Tensor]], **kw: Any
) -> list[Any]:
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
        t.join(30)
    return out


@pytest.fixture(params=["file", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"file://{tmp_path}" if request.param == "file" else f"memory://os-{uuid.uuid4().hex}"


def test_three_replicas_average_exactly(url: str) -> None:
    stores = _stores(url, 3)
    values = [[torch.full((2, 3), float(r)), torch.arange(4.0) * r] for r in range(3)]
    stats = _parallel(stores, 0, values)
    assert all(s.participants == [0, 1, 2] for s in stats)
    for v in values:
        assert torch.equal(v[0], torch.full((2, 3), 1.0))
        assert torch.equal(v[1], torch.arange(4.0))


def test_sum_op_and_dtype_preserved(url: str) -> None:
    stores = _stores(url, 2)
    values = [[torch.ones(3, dtype=torch.float64) * (r + 1)] for r in range(2)]
    _parallel(stores, 0, values, op="sum")
    assert values[0][0].dtype == torch.float64 and torch.equal(
        values[0][0], torch.full((3,), 3.0, dtype=torch.float64)
    )


def test_rounds_are_namespaced_and_cleaned_up(url: str) -> None:
    stores = _stores(url, 2, keep_rounds=2)
    for rnd in range(5):
        _parallel(stores, rnd, [[torch.ones(2)], [torch.zeros(2)]])
    assert stores[0].rounds_present() == [3, 4]
    assert stores[0].fs.exists(stores[0].manifest_key(4))
    stores[0].cleanup_run()
    assert stores[0].rounds_present() == []


def test_local_writes_go_through_a_temporary_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    store = ObjectStoreAllReduce(f"file://{tmp_path}", "run", rank=0, world_size=1)
    links: list[tuple[str, str]] = []
    renames: list[tuple[str, str]] = []
    real_link, real_replace = os.link, os.replace

    def link(a: str, b: str) -> None:
        real_link(a, b)  # recorded once it succeeded (the first link into a new round's folder makes it)
        links.append((a, b))

    def replace(a: str, b: str) -> None:
        real_replace(a, b)
        renames.append((a, b))

    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "replace", replace)
    store.allreduce(0, [torch.ones(1)])
    # object and manifest: create-only link of a complete temporary file; the first marker: atomic rename
    assert [b for _, b in links] == [store.object_key(0, 0), store.manifest_key(0)]
    assert [b for _, b in renames] == [store.marker_key(0)]
    temporary = [Path(a) for a, _ in links + renames]
    assert all(t.name.startswith(".tmp-") and t.parent == Path(store.key("tmp")) for t in temporary)
    store.wait_cleanup()
    assert not list(Path(store.prefix).rglob(".tmp-*"))  # every temporary name is gone
    assert not any(Path(a).exists() for a, _ in links + renames)


def test_average_is_written_in_pieces_without_a_payload_sized_accumulator(url: str) -> None:
    """Contiguous CPU targets receive the average piece by piece through a cache-sized scratch: no
    accumulator as large as the payload. Targets that share memory (a tied weight passed twice, views
    of one buffer) or are not contiguous go through the accumulators, so every one is still averaged
    from the values the replicas published. Bits equal ``(x0 + x1 + x2) / 3`` in float32."""
    from composer_diloco import object_store

    n = object_store.reduce.REDUCE_PIECE * 2 + 5  # two full pieces and a short one
    g = torch.Generator().manual_seed(0)
    big = [torch.randn(n, generator=g) for _ in range(3)]
    stores = _stores(url, 3)
    values = [[big[r].clone(), torch.randn(3, 4, generator=g).T] for r in range(3)]  # second: not contiguous
    shared = [torch.arange(8.0) * (r + 1) for r in range(3)]
    tied = [torch.full((5,), float(r)) for r in range(3)]
    for r in range(3):
        values[r] += [shared[r][:4], shared[r][4:], tied[r], tied[r]]
    want = [(v[0] + v[1] + v[2]) / 3 for v in zip(*[[t.clone() for t in vs] for vs in values])]
    _parallel(stores, 0, values)
    for vs in values:
        assert all(torch.equal(t, w) for t, w in zip(vs, want))
    assert all(sum(a.numel() for a in s._acc) < 100 for s in stores)  # only the small fallback targets


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("numel", [1 << 18, 1 << 19])  # 1 MiB, 2 MiB
def test_large_local_objects_are_mapped_small_or_signed_ones_read_into_a_kept_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signed: bool, numel: int
) -> None:
    """Without an HMAC key, the other replicas' objects of 2 MiB or more on a local filesystem are mapped: the
    checksums and the sum read the page cache in place (no buffer, no copy). Smaller ones are read into a buffer
    kept for that replica across rounds: mapping 1 MiB, then hashing and checking it, cost 85 µs against 56 read
    (the mapping's page faults and its unmapping outweigh a copy that stays in cache); on main before this test
    a 1 MiB object was mapped. Signed objects are always copied first: a writer who changed a mapped file between
    its check and its use would bypass the HMAC."""
    if signed:
        monkeypatch.setenv("COMPOSER_DILOCO_HMAC_KEY", KEY)
    stores = _stores(f"file://{tmp_path}", 2)
    mapped = numel >= 1 << 19 and not signed
    for round_id in range(2):
        values = [
            [torch.full((numel,), float(r + round_id)), torch.arange(6.0).reshape(2, 3) * r] for r in range(2)
        ]
        _parallel(stores, round_id, values)
        for v in values:
            assert torch.equal(v[0], torch.full((numel,), 0.5 + round_id))
            assert torch.equal(v[1], torch.arange(6.0).reshape(2, 3) / 2)
        if round_id == 0:
            buffers = {id(b) for s in stores for b in s._buffers.values()}
    assert {id(b) for s in stores for b in s._buffers.values()} == buffers  # kept across rounds
    assert all(bool(s._buffers) != mapped for s in stores)  # a read buffer only for what is not mapped
    key = stores[0].object_key(1, 1)
    view = stores[0]._read(key, slot="obj-1")
    assert isinstance(view, memoryview) and (type(view.obj).__name__ == "mmap") == mapped
    Path(key).unlink()  # cleanup deletes objects; a mapping stays readable, a read buffer holds its copy
    decoded = stores[0].decode(view, round_id=1, rank=1, key=key)
    assert torch.equal(decoded.tensors[0], torch.full((numel,), 2.0))


def test_straggler_fail_raises_naming_the_missing_rank(url: str) -> None:
    (store, _) = _stores(url, 2, timeout_s=0.3, on_timeout="fail")
    t0 = time.monotonic()
    with pytest.raises(StragglerTimeoutError, match=r"ranks \[1\].*timeout_s=0.3"):
        store.allreduce(0, [torch.ones(2)])
    assert 0.3 <= time.monotonic() - t0 < 5


def test_straggler_proceed_goes_on_and_the_late_replica_adopts_the_same_result(url: str) -> None:
    fast, late = _stores(url, 2, timeout_s=0.3, on_timeout="proceed")
    a = [torch.full((3,), 2.0)]
    stats = fast.allreduce(0, a)
    assert stats.participants == [0] and stats.excluded == {1: "no object"}
    assert torch.equal(a[0], torch.full((3,), 2.0))
    b = [torch.full((3,), 10.0)]  # arrives after the manifest: excluded, but ends identical
    late_stats = late.allreduce(0, b)
    assert late_stats.participants == [0] and late_stats.adopted
    assert torch.equal(b[0], a[0])


def test_proceed_respects_min_replicas(url: str) -> None:
    store = ObjectStoreAllReduce(
        url, "run", rank=0, world_size=3, timeout_s=0.2, on_timeout="proceed", min_replicas=2
    )
    with pytest.raises(StragglerTimeoutError, match="min_replicas=2"):
        store.allreduce(0, [torch.ones(1)])


def _write_raw(store: ObjectStoreAllReduce, key: str, data: bytes) -> None:
    store.fs.makedirs(key.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(key, data)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda d: d[: len(d) // 2], "fails its checksum"),  # partial object (truncated upload)
        (lambda d: d[:-1], "fails its checksum"),  # one byte short
        (lambda d: b"garbage" * 10, "no composer-diloco header"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "fails its checksum"),  # one flipped bit
    ],
)
def test_corrupt_or_partial_object_fails_clearly(url: str, damage: Any, match: str) -> None:
    store0, store1 = _stores(url, 2, timeout_s=0.3)
    _write_raw(store0, store0.object_key(0, 1), damage(_encode(store1, 0, [torch.ones(2)])))
    with pytest.raises(CorruptObjectError, match=match) as info:
        store0.allreduce(0, [torch.ones(2)])
    assert store0.object_key(0, 1) in str(info.value)


def test_corrupt_object_with_proceed_is_excluded_not_averaged(url: str) -> None:
    store0, store1 = _stores(url, 2, timeout_s=0.3, on_timeout="proceed")
    data = _encode(store1, 0, [torch.full((2,), 100.0)])
    _write_raw(store0, store0.object_key(0, 1), data[:-10])
    mine = [torch.ones(2)]
    stats = store0.allreduce(0, mine)
    assert stats.participants == [0] and "fails its checksum" in stats.excluded[1]
    assert torch.equal(mine[0], torch.ones(2))


def test_partial_object_replaced_by_complete_one_is_reread(url: str) -> None:
    store0, store1 = _stores(url, 2, timeout_s=5)
    data = _encode(store1, 0, [torch.full((2,), 3.0)])
    key = store0.object_key(0, 1)
    _write_raw(store0, key, data[:20])

    def finish_later() -> None:
        time.sleep(0.3)
        _write_raw(store0, key, data)

    threading.Thread(target=finish_later).start()
    mine = [torch.ones(2)]
    assert store0.allreduce(0, mine).participants == [0, 1]
    assert torch.equal(mine[0], torch.full((2,), 2.0))


def test_object_from_another_rank_or_run_is_rejected(url: str) -> None:
    store0, store1 = _stores(url, 2, timeout_s=0.3)
    other_run = ObjectStoreAllReduce(url, "other", rank=1, world_size=2)
    with pytest.raises(CorruptObjectError, match="rank=0, expected 1"):
        store1.decode(_encode(store0, 0, [torch.ones(1)]), round_id=0, rank=1)
    with pytest.raises(CorruptObjectError, match="run_id='other'"):
        store1.decode(_encode(other_run, 0, [torch.ones(1)]), round_id=0, rank=1)
    with pytest.raises(CorruptObjectError, match="round=0, expected 1"):
        store1.decode(_encode(store1, 0, [torch.ones(1)]), round_id=1, rank=1)


def _frame(meta: dict[str, Any], body: bytes) -> bytes:
    """A format-4 object built from the documented layout (independently of the encoder):
    MAGIC | SHA-256(lead) | lead | body, lead = len(meta) | len(digest) | meta | XXH3-64 of the body."""
    import hashlib
    import json

    import xxhash
    from composer_diloco.object_store.codec import MAGIC

    raw = json.dumps(meta).encode()
    table = xxhash.xxh3_64(body).intdigest().to_bytes(8, "big")
    lead = len(raw).to_bytes(4, "little") + len(table).to_bytes(4, "little") + raw + table
    return MAGIC + hashlib.sha256(lead).digest() + lead + body


def test_checksummed_object_with_a_lying_layout_is_rejected(url: str) -> None:
    store = ObjectStoreAllReduce(url, "run", rank=0, world_size=1)
    meta: dict[str, Any] = {"run_id": "run", "round": 0, "rank": 0, "world_size": 1, "quantized": False}
    meta["layout"] = [{"shape": [1000], "dtype": "float32", "wire": "float32", "scale": None, "nbytes": 16}]
    with pytest.raises(CorruptObjectError, match="invalid tensor layout"):  # 1000 floats in 16 bytes
        store.decode(_frame(meta, b"\0" * 16), round_id=0, rank=0, key="k")
    meta["layout"] = [{"shape": [0], "dtype": "float32", "wire": "Tensor", "scale": None, "nbytes": 0}]
    with pytest.raises(CorruptObjectError, match="invalid tensor layout"):  # never getattr'd into a callable
        store.decode(_frame(meta, b""), round_id=0, rank=0, key="k")


@pytest.mark.parametrize("signed", [False, True], ids=["xxh3", "hmac"])
def test_every_flipped_byte_is_detected_with_a_named_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signed: bool
) -> None:
    """Flip each byte of an object (3 tensors; magic, tag, lengths, meta, digest, every byte of the
    body): every single one is refused, naming the key."""
    if signed:
        monkeypatch.setenv("COMPOSER_DILOCO_HMAC_KEY", KEY)
    store = ObjectStoreAllReduce(f"file://{tmp_path}", "run", rank=0, world_size=1)
    data = _encode(
        store, 0, [torch.arange(40.0), torch.zeros(0), torch.full((3,), 2.0, dtype=torch.bfloat16)]
    )
    assert len(json.loads(data[48 : 48 + int.from_bytes(data[40:44], "little")])["layout"]) == 3
    assert store.decode(data, round_id=0, rank=0).tensors[0].equal(torch.arange(40.0))
    kinds = Counter()
    for offset in range(len(data)):
        bad = bytearray(data)
        bad[offset] ^= 0x01 if offset % 2 else 0x80
        with pytest.raises(CorruptObjectError) as info:
            store.decode(bytes(bad), round_id=0, rank=0, key=f"obj@{offset}")
        message = str(info.value)
        assert f"obj@{offset}" in message and "\n" not in message
        if offset >= 8:  # past the magic: the checksum / HMAC names what failed
            assert ("HMAC-SHA256 check" if signed else "fails its checksum") in message, (offset, message)
            assert isinstance(info.value, AuthenticationError) == signed
        kinds["body" if "body bytes" in message else "header"] += 1
    assert kinds["body"] == 40 * 4 + 3 * 2 and kinds["header"] == len(data) - kinds["body"]


@pytest.mark.parametrize(
    ("magic", "name"),
    [
        (b"CDILOCO1", "1"),
        (b"CDILOCH1", "1"),
        (b"CDILOCO2", "2"),
        (b"CDILOCH2", "2"),
        (b"CDILOCO3", "3"),
        (b"CDILOCH3", "3"),
    ],
)
def test_older_formats_are_refused_by_name(url: str, magic: bytes, name: str) -> None:
    import hashlib

    store0, _ = _stores(url, 2, timeout_s=0.3)
    body = b"\x02\x00\x00\x00{}"
    old = magic + hashlib.sha256(body).digest() + body
    with pytest.raises(CorruptObjectError, match=rf"object format {name} .*same composer-diloco version"):
        store0.decode(old, round_id=0, rank=1, key="k")


@pytest.mark.parametrize("bad", ["..", ".", "a/../b", "../escape", "/abs", "", ".hidden", "a/b"])
def test_keys_cannot_escape_the_run_prefix(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="run_id"):
        ObjectStoreAllReduce(f"file://{tmp_path}", bad, rank=0, world_size=1)
    store = ObjectStoreAllReduce(f"file://{tmp_path}", "run", rank=0, world_size=1)
    with pytest.raises(ValueError, match="escape"):
        store.key("rounds", bad)
    with pytest.raises(ValueError):
        safe_part("x", bad)


def test_url_with_dotdot_segment_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'\.\.'"):
        ObjectStoreAllReduce(f"file://{tmp_path}/a/../b", "run", rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"'\.\.'"):
        ObjectStoreAllReduce("memory://bucket/../x", "run", rank=0, world_size=1)


@pytest.mark.parametrize(("rank", "world"), [(2, 2), (-1, 2), (True, 2), (0, 0), ("0", 1)])
def test_ranks_are_validated(tmp_path: Path, rank: Any, world: Any) -> None:
    with pytest.raises(ValueError, match=r"rank|world_size"):
        ObjectStoreAllReduce(f"file://{tmp_path}", "run", rank=rank, world_size=world)


def test_nan_and_layout_mismatch_are_refused(url: str) -> None:
    store0, store1 = _stores(url, 2, timeout_s=5)
    with pytest.raises(ValueError, match="NaN/inf"):
        store0.allreduce(0, [torch.tensor([1.0, float("nan")])])
    with pytest.raises(ValueError, match="NaN/inf"):
        _encode(store0, 0, [torch.tensor([1.0, float("-inf")])])
    _encode(store0, 0, [torch.full((4,), 3e38)])  # finite values whose float32 sum overflows are fine
    with pytest.raises(RoundWithdrawnError, match="rank 0 refused its own payload for round 0"):
        store0.allreduce(1, [torch.ones(2)])  # it missed round 0's average: it may not join round 1
    store0, store1 = _stores(url, 2, timeout_s=5)  # restarted
    out = _parallel([store0, store1], 1, [[torch.ones(2)], [torch.ones(2), torch.ones(1)]])
    assert all(isinstance(o, ObjectStoreError) and "same parameters" in str(o) for o in out)


def test_bad_options_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="on_timeout"):
        ObjectStoreAllReduce(f"file://{tmp_path}", "r", rank=0, world_size=1, on_timeout="wait")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep_rounds"):
        ObjectStoreAllReduce(f"file://{tmp_path}", "r", rank=0, world_size=1, keep_rounds=1)
    with pytest.raises(ValueError, match="min_replicas"):
        ObjectStoreAllReduce(f"file://{tmp_path}", "r", rank=0, world_size=1, min_replicas=2)


def test_fp8_quantisation_round_trip_error_bound() -> None:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_fp8(t)
    assert q.dtype == torch.float8_e4m3fn and q.element_size() == 1
    back = dequantize_fp8(q, scale)
    # e4m3 keeps 3 mantissa bits: relative error ≤ 2^-4 for normal values, absolute ≤ scale·2^-9 near 0
    assert ((back - t).abs() <= t.abs() * 2**-4 + scale * 2**-9).all()
    zero_q, zero_scale = quantize_fp8(torch.zeros(3))
    assert zero_scale == 1.0 and torch.equal(dequantize_fp8(zero_q, zero_scale), torch.zeros(3))


# ---- the committed manifest is the single source of truth (process tests: test_store_faults.py) ----


def test_rerun_of_a_committed_round_adopts_it_and_never_overwrites(url: str) -> None:
    stores = _stores(url, 2, timeout_s=10)
    _parallel(stores, 0, [[torch.full((2,), 2.0)], [torch.full((2,), 4.0)]])
    stored = stores[1].fs.cat_file(stores[1].object_key(0, 1))
    again = [torch.full((2,), 22.0)]
    stats = stores[1].allreduce(0, again)
    assert stats.adopted and stats.participants == [0, 1] and torch.equal(again[0], torch.full((2,), 3.0))
    assert stores[1].fs.cat_file(stores[1].object_key(0, 1)) == stored


def test_own_object_from_an_earlier_attempt_is_the_contribution(url: str) -> None:
    store0, store1 = _stores(url, 2, timeout_s=10)
    store1.put_if_absent(
        store1.object_key(0, 1), _encode(store1, 0, [torch.full((2,), 10.0)])
    )  # then crashed
    out = _parallel([store0, store1], 0, [[torch.zeros(2)], [torch.full((2,), 20.0)]])
    assert out[1].adopted and not out[0].adopted
    assert all(o.participants == [0, 1] for o in out)


def test_own_object_from_an_earlier_attempt_gives_the_same_average_everywhere(url: str) -> None:
    store0, store1 = _stores(url, 2, timeout_s=10)
    store1.put_if_absent(store1.object_key(0, 1), _encode(store1, 0, [torch.full((2,), 10.0)]))
    values = [[torch.zeros(2)], [torch.full((2,), 20.0)]]
    _parallel([store0, store1], 0, values)
    assert torch.equal(values[0][0], torch.full((2,), 5.0)) and torch.equal(values[1][0], values[0][0])


def test_object_replaced_after_commit_is_refused(url: str) -> None:
    store0, store1 = _stores(url, 2, timeout_s=0.3, on_timeout="proceed")
    assert store0.allreduce(0, [torch.ones(2)]).participants == [0]
    forged = _encode(ObjectStoreAllReduce(url, "run", rank=0, world_size=2), 0, [torch.full((2,), 99.0)])
    store0.fs.rm(store0.object_key(0, 0))
    _write_raw(store0, store0.object_key(0, 0), forged)  # a foreign writer replaces the committed object
    late = [torch.zeros(2)]
    with pytest.raises(CorruptObjectError, match="not the one committed"):
        store1.allreduce(0, late)
    assert torch.equal(late[0], torch.zeros(2))


def test_expired_round_raises_and_writes_nothing(url: str) -> None:
    fast, late = _stores(url, 2, timeout_s=0.2, on_timeout="proceed", keep_rounds=2)
    for rnd in range(4):
        fast.allreduce(rnd, [torch.ones(1)])
    mine = [torch.full((1,), 5.0)]
    with pytest.raises(
        RoundExpiredError, match=r"round 0 .*store already holds round 3.*keep_rounds=2.*checkpoint"
    ):
        late.allreduce(0, mine)
    assert torch.equal(mine[0], torch.full((1,), 5.0)) and fast.rounds_present() == [2, 3]


def test_lost_manifest_is_detected_from_progress_markers(url: str) -> None:
    fast, late = _stores(url, 2, timeout_s=0.2, on_timeout="proceed")
    fast.allreduce(0, [torch.ones(1)])
    fast.fs.rm(fast.manifest_key(0))
    with pytest.raises(RoundExpiredError, match=r"rank 0 accepted its manifest.*its manifest is gone"):
        late.allreduce(0, [torch.zeros(1)])


def test_manifest_proposed_again_after_a_deletion_race_is_a_named_conflict(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The late replica checks for evidence before a committed replica's marker exists (forced
    here), proposes a second manifest, and finds the other marker when it accepts."""
    fast, late = _stores(url, 2, timeout_s=0.2, on_timeout="proceed")
    fast.allreduce(0, [torch.ones(1)])
    fast.fs.rm(fast.manifest_key(0))
    monkeypatch.setattr(late, "_commit_evidence", lambda round_id: None)
    mine = [torch.full((1,), 3.0)]
    with pytest.raises(RoundConflictError, match="rank 0 applied a different manifest"):
        late.allreduce(0, mine)
    assert torch.equal(mine[0], torch.full((1,), 3.0))  # nothing applied


# ---- in step: the committed-round check rides on the wait (issue 19: 1 MiB rounds) -------------


@pytest.fixture(params=["file", "memory", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Store kwargs for file://, memory:// and moto's s3:// (the listing paths differ on each)."""
    if request.param == "s3":
        options = request.getfixturevalue("moto_s3")
        return {"url": f"s3://diloco-test/{uuid.uuid4().hex}", "storage_options": options}
    if request.param == "file":
        return {"url": f"file://{tmp_path}"}
    return {"url": f"memory://os-{uuid.uuid4().hex}"}


def _at(where: dict[str, Any], world: int, **kw: Any) -> list[ObjectStoreAllReduce]:
    return _stores(where["url"], world, storage_options=where.get("storage_options"), **kw)


def _in_step(stores: list[ObjectStoreAllReduce], rounds: range) -> None:
    for rnd in rounds:
        out = _parallel(stores, rnd, [[torch.full((2,), float(r))] for r in range(len(stores))])
        assert all(not isinstance(o, BaseException) for o in out), out


def test_a_replica_in_step_makes_no_committed_round_check(
    where: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After completing round r-1 a replica has nothing of round r: the check (a manifest GET, a
    rounds LIST and a GET per peer marker on S3) is left to the wait, which sees what it would. A
    fresh replica (restart) and a re-run still check first. Fails on the old main: 2 checks a round."""
    stores = _at(where, 2, timeout_s=30)
    checks: Counter[int] = Counter()
    committed = ObjectStoreAllReduce._committed

    def counting(self: ObjectStoreAllReduce, round_id: int) -> Any:
        checks[self.rank] += 1
        return committed(self, round_id)

    monkeypatch.setattr(ObjectStoreAllReduce, "_committed", counting)
    _in_step(stores, range(4))
    assert checks == {0: 1, 1: 1}  # round 0 only: nothing is known before a replica's first round
    again = [torch.full((2,), 9.0)]
    assert stores[1].allreduce(2, again).adopted and torch.equal(again[0], torch.full((2,), 0.5))
    assert checks[1] == 2  # a re-run of a committed round is checked first, and adopted
    stores[0].cleanup_run()


def test_in_step_straggler_adopts_the_round_committed_without_it(where: dict[str, Any]) -> None:
    """Rank 2 completed round 0 in step, then arrives at round 1 after ranks 0 and 1 committed it
    without it: it writes its object (never averaged), finds the manifest, and ends identical."""
    stores = _at(where, 3, timeout_s=0.3, on_timeout="proceed")
    _in_step(stores, range(1))
    out = _parallel(stores[:2], 1, [[torch.full((2,), 2.0)], [torch.full((2,), 4.0)]])
    assert [o.participants for o in out] == [[0, 1], [0, 1]]
    late = [torch.full((2,), 100.0)]
    stats = stores[2].allreduce(1, late)
    assert stats.participants == [0, 1] and torch.equal(late[0], torch.full((2,), 3.0))
    assert stats.adopted  # its new values are not the round's, as when it checks first
    stores[0].cleanup_run()


def test_in_step_replica_finds_a_manifest_committed_while_it_waits(where: dict[str, Any]) -> None:
    """Rank 1 is dead; rank 0 gives up on it after 0.3 s and commits {0, 2}. Rank 2, in step and
    waiting 30 s for rank 1, sees the manifest at its next listing instead of its own timeout."""
    s0, s1, s2 = _at(where, 3, timeout_s=30, on_timeout="proceed")
    _in_step([s0, s1, s2], range(1))
    s0.timeout_s = 0.3
    values = [[torch.full((2,), 2.0)], [torch.full((2,), 6.0)]]
    t0 = time.monotonic()
    out = _parallel([s0, s2], 1, values)
    assert [o.participants for o in out] == [[0, 2], [0, 2]], out
    assert time.monotonic() - t0 < 10
    assert torch.equal(values[0][0], torch.full((2,), 4.0)) and torch.equal(values[1][0], values[0][0])
    s0.cleanup_run()


@pytest.mark.parametrize("exchange", ["full", "sharded"])
def test_in_step_replica_far_behind_gets_expired_and_recreates_nothing(
    where: dict[str, Any], exchange: str
) -> None:
    """Rank 1 completed round 0 in step; rank 0 then ran rounds 1-3 alone (keep_rounds=2 deleted
    round 1). Rank 1 arrives at round 1: its listing shows the later rounds, so it raises
    RoundExpiredError at once (not after its 30 s timeout), takes its object back, and leaves its
    values alone; the store holds rounds 2 and 3 only (sharded: its shards and index are gone too)."""
    fast, late = _at(where, 2, timeout_s=30, on_timeout="proceed", keep_rounds=2, exchange=exchange)
    _in_step([fast, late], range(1))
    fast.timeout_s = 0.2
    for rnd in range(1, 4):
        assert fast.allreduce(rnd, [torch.ones(2)]).participants == [0]
    fast.wait_cleanup()
    mine = [torch.full((2,), 5.0)]
    t0 = time.monotonic()
    with pytest.raises(RoundExpiredError, match=r"round 1 .*store already holds round 3.*checkpoint"):
        late.allreduce(1, mine)
    assert time.monotonic() - t0 < 10
    assert torch.equal(mine[0], torch.full((2,), 5.0))
    assert fast.rounds_present() == [2, 3]
    fast.cleanup_run()


@pytest.mark.parametrize("exchange", ["full", "sharded"])
def test_round_deleted_while_an_in_step_replica_reads_it_is_expired_and_taken_back(
    where: dict[str, Any], exchange: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race behind the previous test: rank 1 reads rank 0's object of round 1, and round 1 is
    deleted (rank 0's cleanup) before rank 1 proposes. Its proposal wins the now empty round, and
    rank 0's marker (round 1 under another manifest, and on to round 3) names the round expired:
    rank 1 applies nothing, takes back its object (sharded: shards and index), its manifest and its
    marker entry."""
    fast, late = _at(where, 2, timeout_s=30, on_timeout="proceed", keep_rounds=2, exchange=exchange)
    _in_step([fast, late], range(1))
    fast.timeout_s = 0.2
    monkeypatch.setattr(fast, "_cleanup", lambda *args: None)  # round 1 is still there when rank 1 reads it
    for rnd in range(1, 4):
        fast.allreduce(rnd, [torch.ones(2)])
    take = ObjectStoreAllReduce._take

    def then_deleted(self: ObjectStoreAllReduce, round_id: int, *args: Any) -> None:
        take(self, round_id, *args)
        fast._remove_round(round_id)  # the cleanup lands right after the read

    monkeypatch.setattr(late, "_take", types.MethodType(then_deleted, late))
    mine = [torch.full((2,), 5.0)]
    named = {  # the sharded exchange finds rank 0's shards gone before it gets to the markers
        "full": r"round 1 .*rank 0 applied another manifest.*round 3",
        "sharded": r"round 1 .*shard-00001-rank-00000-.* is gone",
    }
    with pytest.raises(RoundExpiredError, match=named[exchange]):
        late.allreduce(1, mine)
    assert torch.equal(mine[0], torch.full((2,), 5.0))
    assert fast.rounds_present() == [2, 3]
    assert set(late._read_marker(1) or {}) == {0}  # round 1's entry was taken back
    fast.cleanup_run()


def test_the_others_propose_when_the_rank_that_should_died_after_its_object(where: dict[str, Any]) -> None:
    """With every object present rank min(ranks) proposes and the others read its manifest. Rank 0
    published its object and died: rank 1 proposes itself after a few looks, well before its
    timeout, and averages both objects."""
    dead, alive = _at(where, 2, timeout_s=30)
    assert dead.put_if_absent(dead.object_key(0, 0), _encode(dead, 0, [torch.full((2,), 2.0)]))
    mine = [torch.full((2,), 4.0)]
    t0 = time.monotonic()
    stats = alive.allreduce(0, mine)
    assert stats.participants == [0, 1] and torch.equal(mine[0], torch.full((2,), 3.0))
    assert time.monotonic() - t0 < 5
    alive.cleanup_run()


def test_one_participant_per_round_deletes_and_a_leftover_round_is_swept(
    where: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each old round is deleted once (by ranks[round % n]), not by every replica, and the deletion
    takes every round up to it: a round a dead cleaner left behind goes with the next one. Fails on
    the old main: 2 deletions per round, and the leftover round stays."""
    stores = _at(where, 2, timeout_s=30, keep_rounds=2)
    removals: Counter[int] = Counter()
    remove = ObjectStoreAllReduce._remove_round

    def counting(self: ObjectStoreAllReduce, old: int) -> None:
        removals[old] += 1
        remove(self, old)

    monkeypatch.setattr(ObjectStoreAllReduce, "_remove_round", counting)
    _in_step(stores, range(4))
    for s in stores:
        s.wait_cleanup()
    assert removals == {0: 1, 1: 1} and stores[0].rounds_present() == [2, 3]
    stray = _encode(stores[1], 0, [torch.ones(2)])  # round 0 again, as a cleaner that died would leave it
    assert stores[1].put_if_absent(stores[1].object_key(0, 1), stray)
    _in_step(stores, range(4, 5))
    for s in stores:
        s.wait_cleanup()
    assert stores[0].rounds_present() == [3, 4]
    stores[0].cleanup_run()


def _nan_object(store: ObjectStoreAllReduce, rank: int, value: float) -> bytes:
    """A checksum-valid object for (round 0, rank) holding ``value`` (encode refuses NaN)."""
    meta: dict[str, Any] = {"run_id": "run", "round": 0, "rank": rank, "world_size": store.world_size}
    meta.update(quantized=False)
    meta["layout"] = [{"shape": [2], "dtype": "float32", "wire": "float32", "scale": None, "nbytes": 8}]
    return _frame(meta, torch.tensor([1.0, value]).numpy().tobytes())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_checksum_valid_non_finite_object_is_refused_on_read(url: str, value: float) -> None:
    store0, _ = _stores(url, 2, timeout_s=0.3)
    with pytest.raises(NonFiniteObjectError, match="NaN/inf"):
        store0.decode(_nan_object(store0, 1, value), round_id=0, rank=1, key="k")
    _write_raw(store0, store0.object_key(0, 1), _nan_object(store0, 1, value))
    with pytest.raises(NonFiniteObjectError, match=r"ranks \[1\].*NaN/inf"):
        store0.allreduce(0, [torch.ones(2)])


def test_non_finite_object_with_proceed_is_excluded(url: str) -> None:
    store0, _ = _stores(url, 2, timeout_s=0.3, on_timeout="proceed")
    _write_raw(store0, store0.object_key(0, 1), _nan_object(store0, 1, float("nan")))
    mine = [torch.ones(2)]
    stats = store0.allreduce(0, mine)
    assert (
        stats.participants == [0] and "NaN/inf" in stats.excluded[1] and torch.equal(mine[0], torch.ones(2))
    )


KEY = "0123456789abcdef0123456789abcdef"


def test_hmac_signed_round_trip_and_refusals(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COMPOSER_DILOCO_HMAC_KEY", raising=False)
    plain = ObjectStoreAllReduce(url, "run", rank=1, world_size=2)
    monkeypatch.setenv("COMPOSER_DILOCO_HMAC_KEY", "f" * 32)
    wrong = ObjectStoreAllReduce(url, "run", rank=1, world_size=2)
    monkeypatch.setenv("COMPOSER_DILOCO_HMAC_KEY", KEY)
    store0, store1 = _stores(url, 2, timeout_s=10)
    signed = _encode(store1, 0, [torch.ones(2)])
    assert _encode(plain, 0, [torch.ones(2)]).startswith(b"CDILOCO4")
    assert signed.startswith(b"CDILOCH4") and store0.decode(signed, round_id=0, rank=1).tensors[
        0
    ].tolist() == [1, 1]
    with pytest.raises(AuthenticationError, match="not authenticated") as unsigned:
        store0.decode(_encode(plain, 0, [torch.ones(2)]), round_id=0, rank=1, key="k")
    with pytest.raises(AuthenticationError, match="HMAC-SHA256 check") as forged:
        store0.decode(_encode(wrong, 0, [torch.ones(2)]), round_id=0, rank=1, key="k")
    with pytest.raises(AuthenticationError, match="COMPOSER_DILOCO_HMAC_KEY is not set") as keyless:
        plain.decode(signed, round_id=0, rank=1, key="k")
    for info in (unsigned, forged, keyless):
        assert KEY[:8] not in str(info.value) and "f" * 8 not in str(info.value)
    values = [[torch.full((2,), 1.0)], [torch.full((2,), 3.0)]]
    assert all(s.participants == [0, 1] for s in _parallel([store0, store1], 0, values))
    assert torch.equal(values[0][0], torch.full((2,), 2.0))
    raw = store0.fs.cat_file(store0.manifest_key(0))
    assert b'"hmac"' in raw and KEY.encode() not in raw


def test_hmac_refuses_an_unsigned_manifest_and_excludes_unsigned_objects(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COMPOSER_DILOCO_HMAC_KEY", raising=False)
    plain1 = ObjectStoreAllReduce(url, "run", rank=1, world_size=2)
    _write_raw(plain1, plain1.object_key(0, 1), _encode(plain1, 0, [torch.full((2,), 50.0)]))  # injected
    monkeypatch.setenv("COMPOSER_DILOCO_HMAC_KEY", KEY)
    store0 = ObjectStoreAllReduce(url, "run", rank=0, world_size=2, timeout_s=0.3, on_timeout="proceed")
    mine = [torch.ones(2)]
    stats = store0.allreduce(0, mine)
    assert stats.participants == [0] and "not authenticated" in stats.excluded[1]
    assert torch.equal(mine[0], torch.ones(2))  # the injected 50.0 is never averaged
    monkeypatch.delenv("COMPOSER_DILOCO_HMAC_KEY")
    keyless = ObjectStoreAllReduce(url, "run2", rank=0, world_size=2, timeout_s=0.2, on_timeout="proceed")
    keyless.allreduce(0, [torch.ones(2)])  # a keyless writer commits a manifest
    monkeypatch.setenv("COMPOSER_DILOCO_HMAC_KEY", KEY)
    with pytest.raises(AuthenticationError, match=r"manifest\.json is unsigned"):
        ObjectStoreAllReduce(url, "run2", rank=1, world_size=2, timeout_s=0.3).allreduce(0, [torch.ones(2)])


def test_hmac_key_is_validated_without_echoing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPOSER_DILOCO_HMAC_KEY", "shortsecret")
    with pytest.raises(ValueError, match="shorter than 16 bytes") as info:
        ObjectStoreAllReduce(f"file://{tmp_path}", "run", rank=0, world_size=1)
    assert "shortsec" not in str(info.value)
    monkeypatch.delenv("COMPOSER_DILOCO_HMAC_KEY")
    with pytest.raises(ValueError, match="require_hmac=True but \\$COMPOSER_DILOCO_HMAC_KEY is not set"):
        ObjectStoreAllReduce(f"file://{tmp_path}", "run", rank=0, world_size=1, require_hmac=True)
    monkeypatch.setenv("MY_KEY", KEY)
    store = ObjectStoreAllReduce(f"file://{tmp_path}", "run", rank=0, world_size=1, hmac_key_env="MY_KEY")
    assert _encode(store, 0, [torch.ones(1)]).startswith(b"CDILOCH4")  # signed with $MY_KEY
    assert KEY not in repr(store) and KEY not in str(vars(store))
    with pytest.raises(TypeError, match="pickle"):  # the key never leaves the replica that read it
        pickle.dumps(store._mac)


def test_manager_restored_from_a_checkpoint_adopts_committed_rounds_or_fails_named(url: str) -> None:
    """ObjectStoreManager (the torchft Manager stand-in): a replica restored from a checkpoint
    re-runs round 0 with new values and adopts the committed 3.0; once round 0 is cleaned up, the
    same re-run raises RoundExpiredError from the round's Work.wait and leaves its tensor alone."""
    from composer_diloco import ObjectStoreManager

    def one_round(manager: ObjectStoreManager, value: float) -> torch.Tensor:
        manager.start_quorum()
        tensor = torch.full((2,), value)
        manager.allreduce(tensor).wait()
        assert manager.should_commit()
        return tensor

    managers = [ObjectStoreManager(s) for s in _stores(url, 2, timeout_s=10, on_timeout="proceed")]
    checkpoint = managers[1].state_dict()  # taken before round 0
    out: list[Any] = [None, None]
    threads = [
        threading.Thread(target=lambda i=i, v=v: out.__setitem__(i, one_round(managers[i], v)))
        for i, v in ((0, 2.0), (1, 4.0))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(out[0], torch.full((2,), 3.0)) and torch.equal(out[1], out[0])

    def restored() -> ObjectStoreManager:
        manager = ObjectStoreManager(ObjectStoreAllReduce(url, "run", rank=1, world_size=2, timeout_s=0.2))
        manager.load_state_dict(checkpoint)
        return manager

    again = restored()
    assert torch.equal(one_round(again, 22.0), torch.full((2,), 3.0))
    assert again.store.last.adopted and again.current_step() == 1
    solo = ObjectStoreManager(
        ObjectStoreAllReduce(url, "run", rank=0, world_size=2, timeout_s=0.2, on_timeout="proceed")
    )
    solo.load_state_dict(managers[0].state_dict())
    for _ in range(3):  # rounds 1..3 without rank 1: keep_rounds=2 deletes rounds 0 and 1
        one_round(solo, 1.0)
    late = restored()
    late.start_quorum()
    tensor = torch.full((2,), 22.0)
    work = late.allreduce(tensor)
    with pytest.raises(RoundExpiredError, match=r"round 0 .*checkpoint"):
        work.wait()
    assert torch.equal(tensor, torch.full((2,), 22.0)) and late.current_step() == 0


@pytest.mark.parametrize("exchange", ["full", "sharded"])
def test_round_stats_say_which_phase_the_round_spent_its_time_in(url: str, exchange: str) -> None:
    """A replica that waits 0.4 s for a late peer spends it in ``commit``; every phase is timed from the end of
    the one before, so together they cover the round; a re-run of a committed round publishes nothing."""
    stores = _stores(url, 2, timeout_s=10, exchange=exchange)
    _parallel(stores, 0, [[torch.ones(4)], [torch.ones(4)]])  # warm: the buffers and folders exist
    out: list[Any] = [None, None]

    def late() -> None:
        time.sleep(0.4)
        out[1] = stores[1].allreduce(1, [torch.full((4,), 3.0)])

    thread = threading.Thread(target=late)
    thread.start()
    out[0] = stores[0].allreduce(1, [torch.ones(4)])
    thread.join(30)
    for stats in out:
        assert tuple(stats.phases) == ("publish", "commit", "reduce", "accept", "apply")
        assert all(s >= 0 for s in stats.phases.values())
        assert stats.seconds - 0.05 <= sum(stats.phases.values()) <= stats.seconds
    waited, prompt = out[0].phases, out[1].phases
    assert waited["commit"] >= 0.3 and max(s for p, s in waited.items() if p != "commit") < 0.2
    assert max(prompt.values()) < 0.2

    again = stores[1].allreduce(1, [torch.zeros(4)])
    assert again.adopted and again.phases["publish"] == 0.0 and again.phases["commit"] > 0
