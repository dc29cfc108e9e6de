"""The serverless invariant under faults, with real replica processes over file:// and s3://
(moto's server on 127.0.0.1): every replica that completes round r applies the same average,
or fails with an error naming why.

Replicas run ``tests/store_replica.py:exchange`` in their own processes. Nothing depends on
timing luck: replicas that must meet in a round start together through a gate file, every wait
is bounded and generous, and a replica that must be absent from a round is simply not started.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from contextlib import suppress
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
    procs = [
        start(workdir, store, r, world_size, rounds, gate=str(gate), **kw) for r, rounds in values.items()
    ]
    open_gate(procs, gate)
    return {p.rank: finish(p) for p in procs}


def test_two_replica_processes_average_two_rounds(store: Store, tmp_path: Path) -> None:
    done = run_together(tmp_path, store, 2, {0: [[0, 1.0], [1, 1.0]], 1: [[0, 3.0], [1, 3.0]]}, timeout_s=120)
    for out in done.values():
        assert out["error"] is None and [r["value"] for r in out["results"]] == [2.0, 2.0], out


def test_late_replica_whose_committed_manifest_was_deleted_fails_named(store: Store, tmp_path: Path) -> None:
    done = run_together(
        tmp_path, store, 3, {0: [[0, 1.0]], 1: [[0, 2.0]]}, on_timeout="proceed", timeout_s=10
    )
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


@pytest.mark.parametrize("on_timeout", ["fail", "proceed"])
def test_replica_that_refuses_its_nan_payload_and_goes_on_is_named_by_its_peers(
    store: Store, tmp_path: Path, on_timeout: str
) -> None:
    """Issue 62: rank 1 refuses its own NaN payload of round 1 and goes on to round 2. The healthy replicas
    failed round 1 with "round 1 was already committed ... but its manifest is gone" (it never was). Now
    every replica either completes a round with the others' average or fails naming rank 1's refusal."""
    nan = float("nan")
    values = {
        0: [[0, 1.0], [1, 1.0], [2, 1.0]],
        1: [[0, 3.0], [1, nan], [2, 3.0]],
        2: [[0, 5.0], [1, 5.0], [2, 5.0]],
    }
    done = run_together(
        tmp_path, store, 3, values, timeout_s=20, on_timeout=on_timeout, go_on_after_refusal=True
    )
    for out in done.values():
        assert out["results"][0]["value"] == 3.0, out
        assert "already committed" not in out["message"], out["message"]
    refuser = done[1]
    assert list(refuser["refused"]) == ["1"] and "NaN/inf" in refuser["refused"]["1"], refuser
    # it missed round 1's average: it may not join round 2 (its weights are no longer the others')
    assert refuser["error"] == "RoundWithdrawnError" and len(refuser["results"]) == 1, refuser
    assert (
        "rank 1" in refuser["message"]
        and "round 1" in refuser["message"]
        and "checkpoint" in refuser["message"]
    )
    for rank in (0, 2):
        out = done[rank]
        if on_timeout == "fail":  # the round cannot complete: named at once, nothing applied
            assert out["error"] == "RoundWithdrawnError" and out["unchanged"] and len(out["results"]) == 1, (
                out
            )
            msg = out["message"]
            assert "round 1" in msg and "rank 1" in msg and "NaN/inf" in msg and "never committed" in msg, msg
            assert "on_timeout='proceed'" in msg and "checkpoint" in msg, msg
        else:  # the healthy replicas go on without rank 1, agreeing on every round
            assert out["error"] is None, out
            assert [r["value"] for r in out["results"]] == [3.0, 3.0, 3.0], out
            assert (
                out["results"][1]["participants"] == [0, 2]
                and "NaN/inf" in out["results"][1]["excluded"]["1"]
            )
    if on_timeout == "proceed":
        assert done[0]["results"] == done[2]["results"]


class StallProxy:
    """A TCP proxy in front of moto's S3 server that holds one upload mid-body.

    Everything is forwarded byte for byte, except that once the client sends ``pattern`` (e.g. the
    request line of one object's PUT), the proxy forwards ``after`` more bytes and then holds the
    rest: the upload is in flight, part of its body is at the server. ``stalled`` is set then. When
    the client goes away (SIGKILLed), the proxy closes its server connection, as the kernel of a
    killed client would: the server sees a request that ends mid-body.
    """

    def __init__(self, upstream: tuple[str, int], pattern: bytes, after: int) -> None:
        self.upstream = upstream
        self.pattern = pattern
        self.after = after
        self.stalled = threading.Event()
        self.forwarded_after_match = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        for s in [self._server, *self._sockets]:
            with suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            threading.Thread(target=self._up, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client), daemon=True).start()

    def _down(self, src: socket.socket, dst: socket.socket) -> None:
        with suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with suppress(OSError):
            dst.close()

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        tail = b""
        budget: int | None = None  # bytes still to forward once the pattern was seen
        with suppress(OSError):
            while data := src.recv(65536):
                if budget is None:  # every matching upload is held (a client retry included)
                    seen = tail + data
                    at = seen.find(self.pattern)
                    tail = seen[-(len(self.pattern) - 1) :]
                    if at < 0:
                        dst.sendall(data)
                        continue
                    budget = (at - (len(seen) - len(data))) + self.after  # match offset in data + after
                send = data[: max(0, budget)]
                if send:
                    dst.sendall(send)
                    self.forwarded_after_match += len(send)
                budget -= len(data)
                if budget <= 0:
                    self.stalled.set()
                    while src.recv(65536):  # hold: read and drop until the client dies
                        pass
                    break
        with suppress(OSError):
            dst.close()


@pytest.mark.parametrize("upload", ["put", "multipart"])
def test_sigkill_mid_put_on_s3_never_publishes_a_torn_object(
    upload: str, tmp_path: Path, moto_s3: dict[str, Any]
) -> None:
    """Rank 1's upload is held mid-body by a proxy (2 MiB into a single 4 MB PUT, or into part 2
    of a 12 MB multipart upload in 5 MiB parts; a client retry is held too), the other two
    replicas start and publish, then rank 1 is SIGKILLed while its upload is in flight: the round
    completes without it, and its object never appears (no torn object is ever listed or read)."""
    from urllib.parse import urlparse

    store = Store("s3://diloco-test/faults", f"k-{uuid.uuid4().hex[:10]}", moto_s3)
    admin = store.admin(3)
    numel = 1_000_000 if upload == "put" else 3_000_000
    path = f"PUT /{admin.object_key(0, 1)}".encode()
    pattern = path + (b" HTTP/1.1" if upload == "put" else b"?partNumber=2&")
    moto = urlparse(moto_s3["client_kwargs"]["endpoint_url"])
    held_after = 2 * 2**20  # 2 MiB of the 4 MB PUT body / of the 5 MiB part reach the server, then it hangs
    proxy = StallProxy((str(moto.hostname), int(moto.port or 80)), pattern, after=held_after)
    victim_options = {**moto_s3, "client_kwargs": {"endpoint_url": proxy.url}}
    common: dict[str, Any] = {"numel": numel, "on_timeout": "proceed", "timeout_s": 30}
    if upload == "multipart":
        common["multipart_chunksize"] = 5 * 2**20
    try:
        victim = ReplicaProcess(
            1,
            TARGET,
            {
                "url": store.url,
                "run_id": store.run_id,
                "rank": 1,
                "world_size": 3,
                "rounds": [[0, 100.0]],
                "storage_options": victim_options,
                **common,
            },
            tmp_path,
            replica_env(),
        )
        assert proxy.stalled.wait(WAIT_S), victim.log_text()  # rank 1's upload is in flight
        gate = tmp_path / "gate"
        survivors = [
            start(tmp_path, store, r, 3, [[0, v]], gate=str(gate), **common) for r, v in ((0, 1.0), (2, 3.0))
        ]
        open_gate(survivors, gate)
        deadline = time.monotonic() + WAIT_S
        while not all(admin.fs.exists(admin.object_key(0, r)) for r in (0, 2)):  # both now poll the round
            assert time.monotonic() < deadline
            admin.fs.invalidate_cache()
            time.sleep(0.05)
        assert victim.proc.poll() is None and proxy.stalled.is_set()
        victim.kill()  # SIGKILL while its PUT / multipart upload is in flight
        outs = [finish(p) for p in survivors]
    finally:
        proxy.close()
    assert victim.proc.returncode == -9
    assert proxy.forwarded_after_match >= held_after  # part of the body had reached the server
    for out in outs:
        (res,) = out["results"]
        assert out["error"] is None and res["value"] == 2.0 and res["uniform"]
        assert res["participants"] == [0, 2] and res["excluded"] == {"1": "no object"}  # never a torn one
    admin.fs.invalidate_cache()
    assert not admin.fs.exists(admin.object_key(0, 1))


SECRET = uuid.uuid4().hex + uuid.uuid4().hex  # random: never printed by the code under test


@pytest.mark.parametrize("writer", ["no key", "wrong key"])
def test_hmac_reader_refuses_unsigned_or_wrongly_signed_writer(
    store: Store, tmp_path: Path, writer: str
) -> None:
    other = {"no key": {}, "wrong key": {"COMPOSER_DILOCO_HMAC_KEY": uuid.uuid4().hex}}[writer]
    gate = tmp_path / "gate"
    procs = [
        start(
            tmp_path,
            store,
            0,
            2,
            [[0, 1.0]],
            env={"COMPOSER_DILOCO_HMAC_KEY": SECRET},
            gate=str(gate),
            timeout_s=15,
        ),
        start(tmp_path, store, 1, 2, [[0, 50.0]], env=other, gate=str(gate), timeout_s=15),
    ]
    if writer == "no key":  # the parent's environment must not leak a key into the keyless writer
        assert "COMPOSER_DILOCO_HMAC_KEY" not in os.environ
    open_gate(procs, gate)
    reader, rogue = (finish(p) for p in procs)
    assert reader["results"] == [] and reader["error"] == "AuthenticationError", reader
    assert store.admin(2).object_key(0, 1) in reader["message"]
    assert ("not authenticated" if writer == "no key" else "HMAC-SHA256 check") in reader["message"]
    assert rogue["results"] == [] and rogue["error"] == "AuthenticationError"  # it refuses the reader too
    texts = [p.log_text() for p in procs] + [reader["message"], rogue["message"]]
    for secret in [SECRET, *other.values()]:
        pieces = {secret[i : i + 8] for i in range(len(secret) - 7)}
        assert not any(piece in text for piece in pieces for text in texts)
