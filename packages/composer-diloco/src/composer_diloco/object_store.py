"""ObjectStoreAllReduce: an all-reduce through any fsspec filesystem, with no network path
between replicas (``file://``, ``memory://``, ``s3://``, ``gs://``, …).

One exchange ("round") works like this, for replica ``rank`` of ``world_size``:

1. Encode the tensors (optionally fp8-quantised) into one object with a magic header and a
   SHA-256 of the payload, and write it to ``<root>/<run_id>/rounds/<round>/rank-<rank>.bin``
   atomically: local filesystems write a temporary key and rename it; object stores
   (S3, GCS, memory) make a single PUT visible all at once.
2. Poll the round's folder. Every object is decoded and validated (magic, checksum, run id,
   round, rank, world size, tensor layout); a partial or corrupt object is never averaged.
3. When every rank is present, or when ``timeout_s`` passes, the replica proposes the
   participant set by *creating* ``manifest.json`` with a conditional put (``link`` on local
   filesystems, ``If-None-Match: *`` on S3, a lock on ``memory://``). The first proposal wins
   and every replica, including a late one, averages exactly the ranks it lists: all replicas
   end the round with identical results. On timeout, ``on_timeout="proceed"`` goes on with the
   replicas present (at least ``min_replicas``); ``"fail"`` raises :class:`StragglerTimeoutError`.
4. Average in float32 in rank order (``Σ x_r`` then ``/ n``, the order torchft's gloo path
   uses), write into the caller's tensors, and delete rounds older than ``keep_rounds``.

Every key is built from validated parts and checked to stay under ``<root>/<run_id>/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import posixpath
import re
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import fsspec
import torch

logger = logging.getLogger(__name__)

MAGIC = b"CDILOCO1"
_DIGEST = 32
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_MEMORY_LOCK = threading.Lock()
_DTYPES = {
    name: getattr(torch, name) for name in ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn")
}


class ObjectStoreError(RuntimeError):
    """An exchange through the object store could not complete."""


class StragglerTimeoutError(ObjectStoreError, TimeoutError):
    """Some replicas did not deliver a valid object for a round within ``timeout_s``."""


class CorruptObjectError(ObjectStoreError, ValueError):
    """An object in the store is truncated, corrupt, or belongs to another run/round/rank."""


def safe_part(name: str, value: object) -> str:
    """Validate one key component: letters, digits, ``._-``, no leading dot, no ``/``.

    This is what keeps every key under the run's prefix: ``..``, ``.`` and absolute or nested
    paths are rejected with a ValueError naming the argument.
    """
    if not isinstance(value, str) or not _PART.fullmatch(value) or value in {".", ".."}:
        raise ValueError(
            f"{name}={value!r} is not a safe object-store key component: use letters, digits, '.', '_' "
            "or '-', not starting with '.', with no '/' (keys may never escape the run prefix)."
        )
    return value


@dataclass
class RoundStats:
    """What the last round did (for logs, tests and the benchmark)."""

    round: int = -1
    participants: list[int] = field(default_factory=list)
    excluded: dict[int, str] = field(default_factory=dict)
    bytes_written: int = 0
    bytes_read: int = 0
    seconds: float = 0.0


@dataclass
class _Decoded:
    meta: dict[str, Any]
    tensors: list[torch.Tensor]
    size: int


class ObjectStoreAllReduce:
    """Average lists of tensors across ``world_size`` replicas through an fsspec URL.

    Args:
        url: the store root, e.g. ``file:///scratch/diloco``, ``memory://diloco``,
            ``s3://bucket/prefix``, ``gs://bucket/prefix``.
        run_id: namespace of this training run under ``url`` (validated key component).
        rank: this replica's rank in ``[0, world_size)``.
        world_size: number of replicas.
        timeout_s: how long to wait for the other replicas' objects in one round.
        on_timeout: ``"proceed"`` with the replicas present or ``"fail"`` with
            :class:`StragglerTimeoutError`.
        min_replicas: with ``"proceed"``, the fewest valid replicas a round may average.
        keep_rounds: rounds kept in the store (older ones are deleted; ≥ 2 so that every replica
            can still read the round it is finishing).
        poll_interval_s: delay between listings of the round folder.
        storage_options: passed to ``fsspec.url_to_fs`` (e.g. ``key``/``secret``/``client_kwargs``).
    """

    def __init__(
        self,
        url: str,
        run_id: str,
        *,
        rank: int,
        world_size: int,
        timeout_s: float = 60.0,
        on_timeout: Literal["proceed", "fail"] = "fail",
        min_replicas: int = 1,
        keep_rounds: int = 2,
        poll_interval_s: float = 0.02,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        for name, value, low in (
            ("world_size", world_size, 1),
            ("min_replicas", min_replicas, 1),
            ("keep_rounds", keep_rounds, 2),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}.")
        if min_replicas > world_size:
            raise ValueError(f"min_replicas={min_replicas} cannot exceed world_size={world_size}.")
        if on_timeout not in ("proceed", "fail"):
            raise ValueError(f"on_timeout must be 'proceed' or 'fail', got {on_timeout!r}.")
        if not timeout_s > 0 or not poll_interval_s > 0:
            raise ValueError(
                f"timeout_s and poll_interval_s must be > 0, got {timeout_s}, {poll_interval_s}."
            )
        self.run_id = safe_part("run_id", run_id)
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.on_timeout = on_timeout
        self.min_replicas = min_replicas
        self.keep_rounds = keep_rounds
        self.poll_interval_s = float(poll_interval_s)
        self.url = url
        self.fs, root = fsspec.url_to_fs(url, **dict(storage_options or {}))
        root = root.rstrip("/")
        if any(part in {"..", "."} for part in root.split("/")):
            raise ValueError(f"url={url!r} contains '.' or '..' path segments; pass a normalised store root.")
        self.root = root
        self.prefix = f"{root}/{self.run_id}" if root else self.run_id
        self.last = RoundStats()
        self.bytes_written = 0
        self.bytes_read = 0

    # ---- keys -------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        """A key under the run prefix; every part is validated, the result re-checked."""
        clean = [safe_part("key part", p) for p in parts]
        key = "/".join([self.prefix, *clean])
        if posixpath.normpath(key) != key.rstrip("/") or not key.startswith(self.prefix + "/"):
            raise ValueError(f"key {key!r} escapes the run prefix {self.prefix!r}.")
        return key

    def round_dir(self, round_id: int) -> str:
        return self.key("rounds", f"{_check_round(round_id):010d}")

    def object_key(self, round_id: int, rank: int) -> str:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}.")
        return self.key("rounds", f"{_check_round(round_id):010d}", f"rank-{rank:05d}.bin")

    def manifest_key(self, round_id: int) -> str:
        return self.key("rounds", f"{_check_round(round_id):010d}", "manifest.json")

    # ---- codec ------------------------------------------------------------------------
    def encode(self, round_id: int, tensors: Sequence[torch.Tensor], *, quantize: bool = False) -> bytes:
        """Serialise this replica's tensors for ``round_id`` (fp8 e4m3 + fp32 scale if ``quantize``).

        Layout: ``MAGIC | sha256(body) | body``, ``body = len(meta) (4 bytes, little endian) |
        meta (JSON: run, round, rank, world size, per-tensor dtype/shape/scale) | raw tensor bytes``.
        No pickle: decoding is ``torch.frombuffer`` on validated offsets.
        """
        return self._encode(round_id, tensors, quantize)[0]

    def _encode(
        self, round_id: int, tensors: Sequence[torch.Tensor], quantize: bool
    ) -> tuple[bytes, _Decoded]:
        chunks: list[bytes] = []
        own: list[torch.Tensor] = []
        layout: list[dict[str, Any]] = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or not torch.is_floating_point(t):
                raise ValueError(f"tensor {i} must be a floating-point torch.Tensor, got {type(t).__name__}.")
            host = t.detach().to("cpu").contiguous()
            # fast path: a finite sum proves every value finite; otherwise check element-wise
            # (a huge but finite tensor can overflow the sum)
            if not bool(torch.isfinite(host.sum())) and not bool(torch.isfinite(host).all()):
                raise ValueError(
                    f"tensor {i} of rank {self.rank} in round {round_id} holds NaN/inf; refusing to publish "
                    "it (it would poison every replica's average). Check the inner optimiser / loss."
                )
            entry: dict[str, Any] = {
                "shape": list(host.shape),
                "dtype": str(host.dtype).removeprefix("torch."),
            }
            if quantize:
                q, scale = quantize_fp8(host)
                entry.update(wire="float8_e4m3fn", scale=scale)
                own.append(dequantize_fp8(q, scale))
                wire = q
            else:
                entry.update(wire=entry["dtype"], scale=None)
                own.append(host)
                wire = host
            raw = wire.view(torch.uint8).numpy().tobytes() if wire.numel() else b""
            entry["nbytes"] = len(raw)
            layout.append(entry)
            chunks.append(raw)
        meta = {
            "run_id": self.run_id,
            "round": round_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "quantized": quantize,
            "layout": layout,
        }
        meta_bytes = json.dumps(meta).encode()
        body = b"".join([len(meta_bytes).to_bytes(4, "little"), meta_bytes, *chunks])
        data = MAGIC + hashlib.sha256(body).digest() + body
        return data, _Decoded(meta, own, len(data))

    def decode(self, data: bytes, *, round_id: int, rank: int, key: str = "?") -> _Decoded:
        """Validate and deserialise an object; raise :class:`CorruptObjectError` naming ``key``."""
        head = len(MAGIC) + _DIGEST
        if len(data) < head + 4 or data[: len(MAGIC)] != MAGIC:
            raise CorruptObjectError(
                f"object {key} has no composer-diloco header (partial or foreign write)."
            )
        body = memoryview(data)[head:]
        if hashlib.sha256(body).digest() != data[len(MAGIC) : head]:
            raise CorruptObjectError(
                f"object {key} fails its SHA-256 check ({len(data)} bytes: truncated or corrupt)."
            )
        try:
            meta_len = int.from_bytes(body[:4], "little")
            meta = json.loads(bytes(body[4 : 4 + meta_len]))
            layout = list(meta["layout"])
        except (ValueError, KeyError, TypeError) as exc:  # checksum matched: a foreign/garbage writer
            raise CorruptObjectError(f"object {key} does not decode: {exc}") from exc
        expected = {"run_id": self.run_id, "round": round_id, "rank": rank, "world_size": self.world_size}
        for name, want in expected.items():
            if meta.get(name) != want:
                raise CorruptObjectError(f"object {key} has {name}={meta.get(name)!r}, expected {want!r}.")
        buf = bytearray(body[4 + meta_len :])
        tensors: list[torch.Tensor] = []
        offset = 0
        try:
            for entry in layout:
                wire = _DTYPES.get(entry["wire"])
                dtype = _DTYPES.get(entry["dtype"])
                shape = [int(d) for d in entry["shape"]]
                nbytes = int(entry["nbytes"])
                numel = math.prod(shape)
                if wire is None or dtype is None:
                    raise ValueError(f"unknown dtype {entry['wire']!r}/{entry['dtype']!r}")
                if nbytes != numel * wire.itemsize or offset + nbytes > len(buf):
                    raise ValueError(
                        f"tensor of shape {shape} cannot occupy {nbytes} bytes at offset {offset}"
                    )
                raw = (
                    torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
                    if nbytes
                    else torch.empty(0, dtype=torch.uint8)
                )
                t = raw.view(wire).reshape(shape)
                tensors.append(dequantize_fp8(t, float(entry["scale"])) if meta.get("quantized") else t)
                offset += nbytes
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
            raise CorruptObjectError(f"object {key} has an invalid tensor layout: {exc}") from exc
        if offset != len(buf):
            raise CorruptObjectError(
                f"object {key} carries {len(buf) - offset} trailing bytes beyond its layout."
            )
        return _Decoded(meta, tensors, len(data))

    # ---- storage primitives -----------------------------------------------------------
    def _is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    def put_atomic(self, key: str, data: bytes) -> None:
        """Write ``data`` so that readers see all of it or nothing."""
        if self._is_local():
            parent = posixpath.dirname(key)
            self.fs.makedirs(parent, exist_ok=True)
            tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, key)  # atomic for readers (no fsync: visibility, not crash durability)
        else:  # object stores publish a single PUT atomically
            self.fs.pipe_file(key, data)
        self.bytes_written += len(data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist (conditional put); True if we created it."""
        protocols = _protocols(self.fs)
        if "file" in protocols:
            parent = posixpath.dirname(key)
            self.fs.makedirs(parent, exist_ok=True)
            tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
            try:
                os.link(tmp, key)  # atomic, fails if key exists
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        if "memory" in protocols:
            with _MEMORY_LOCK:
                if self.fs.exists(key):
                    return False
                self.fs.pipe_file(key, data)
                return True
        try:
            self.fs.pipe_file(key, data, mode="create")  # S3: If-None-Match: *
            return True
        except FileExistsError:
            return False
        except (TypeError, ValueError, NotImplementedError) as exc:
            raise ObjectStoreError(
                f"{type(self.fs).__name__} offers no conditional put (pipe_file(mode='create')); "
                "composer-diloco needs one to agree on a round's participants. Use file://, memory:// "
                "or s3:// (or an fsspec backend with create-only writes)."
            ) from exc

    def _read(self, key: str) -> bytes | None:
        self.fs.invalidate_cache(posixpath.dirname(key))  # s3fs answers from a stale listing otherwise
        try:
            data = self.fs.cat_file(key)
        except FileNotFoundError:
            return None
        self.bytes_read += len(data)
        return bytes(data)

    def _list(self, directory: str) -> set[str]:
        self.fs.invalidate_cache(directory)
        try:
            entries = self.fs.ls(directory, detail=False)
        except FileNotFoundError:
            return set()
        return {posixpath.basename(str(e).rstrip("/")) for e in entries}

    # ---- the round --------------------------------------------------------------------
    def allreduce(
        self,
        round_id: int,
        tensors: Sequence[torch.Tensor],
        *,
        quantize: bool = False,
        op: Literal["avg", "sum"] = "avg",
    ) -> RoundStats:
        """Replace ``tensors`` in place with their average (or sum) over the round's participants."""
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}.")
        start = time.monotonic()
        written0, read0 = self.bytes_written, self.bytes_read
        data, own = self._encode(round_id, tensors, quantize)
        self.put_atomic(self.object_key(round_id, self.rank), data)
        decoded: dict[int, _Decoded] = {self.rank: own}
        problems: dict[int, str] = {}
        manifest = self._await_manifest(round_id, decoded, problems)
        participants = manifest["ranks"]
        for r in participants:
            if r not in decoded:
                key = self.object_key(round_id, r)
                raw = self._read(key)
                if raw is None:
                    raise ObjectStoreError(
                        f"round {round_id}: manifest lists rank {r} but {key} is gone (this replica fell more than "
                        f"keep_rounds={self.keep_rounds} rounds behind; restart it from the latest state)."
                    )
                decoded[r] = self.decode(raw, round_id=round_id, rank=r, key=key)
        _check_layouts(decoded, participants, round_id)
        with torch.no_grad():
            for i, t in enumerate(tensors):
                acc = torch.zeros(t.shape, dtype=torch.float32)
                for r in participants:
                    acc += decoded[r].tensors[i].to(torch.float32)
                if op == "avg":
                    acc /= len(participants)
                t.copy_(acc.to(device=t.device, dtype=t.dtype))
        self._cleanup(round_id)
        self.last = RoundStats(
            round=round_id,
            participants=list(participants),
            excluded={
                r: problems.get(r, "no object") for r in range(self.world_size) if r not in participants
            },
            bytes_written=self.bytes_written - written0,
            bytes_read=self.bytes_read - read0,
            seconds=time.monotonic() - start,
        )
        if self.last.excluded:
            logger.warning("round %d proceeded without ranks %s", round_id, self.last.excluded)
        return self.last

    def _await_manifest(
        self, round_id: int, decoded: dict[int, _Decoded], problems: dict[int, str]
    ) -> dict[str, Any]:
        directory = self.round_dir(round_id)
        manifest_key = self.manifest_key(round_id)
        deadline = time.monotonic() + self.timeout_s
        while True:
            names = self._list(directory)
            if "manifest.json" in names:
                found = self._read_manifest(manifest_key, round_id)
                if found is not None:
                    return found
            for r in range(self.world_size):
                if r in decoded or f"rank-{r:05d}.bin" not in names:
                    continue
                key = self.object_key(round_id, r)
                raw = self._read(key)
                if raw is None:
                    continue
                try:
                    decoded[r] = self.decode(raw, round_id=round_id, rank=r, key=key)
                    problems.pop(r, None)
                except CorruptObjectError as exc:
                    problems[r] = str(exc)  # maybe still being written by a non-atomic writer: re-read
            timed_out = time.monotonic() >= deadline
            if len(decoded) == self.world_size or timed_out:
                if timed_out and len(decoded) < self.world_size:
                    missing = {
                        r: problems.get(r, "no object") for r in range(self.world_size) if r not in decoded
                    }
                    corrupt = {r: problems[r] for r in missing if r in problems}
                    if self.on_timeout == "fail" and corrupt:
                        raise CorruptObjectError(
                            f"round {round_id}: invalid objects for ranks {sorted(corrupt)} after timeout_s="
                            f"{self.timeout_s}: {'; '.join(corrupt.values())}. They are never averaged; remove them or "
                            "pass on_timeout='proceed' to continue without those replicas."
                        )
                    if self.on_timeout == "fail":
                        raise StragglerTimeoutError(
                            f"round {round_id}: ranks {sorted(missing)} gave no valid object within "
                            f"timeout_s={self.timeout_s} ({missing}). Raise timeout_s, or pass "
                            "on_timeout='proceed' to continue with the replicas present."
                        )
                    if len(decoded) < self.min_replicas:
                        raise StragglerTimeoutError(
                            f"round {round_id}: only ranks {sorted(decoded)} delivered within timeout_s={self.timeout_s}, "
                            f"fewer than min_replicas={self.min_replicas} ({missing})."
                        )
                proposal = {"round": round_id, "ranks": sorted(decoded), "proposer": self.rank}
                self.put_if_absent(manifest_key, json.dumps(proposal).encode())
                found = self._read_manifest(manifest_key, round_id)
                if found is None:
                    raise ObjectStoreError(
                        f"round {round_id}: manifest {manifest_key} vanished right after creation."
                    )
                return found
            time.sleep(self.poll_interval_s)

    def _read_manifest(self, key: str, round_id: int) -> dict[str, Any] | None:
        raw = self._read(key)
        if raw is None:
            return None
        try:
            manifest = json.loads(raw)
            ranks = manifest["ranks"]
            ok = manifest["round"] == round_id and all(
                isinstance(r, int) and 0 <= r < self.world_size for r in ranks
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptObjectError(f"manifest {key} is not valid JSON of this run: {exc}") from exc
        if not ok or not ranks or sorted(set(ranks)) != ranks:
            raise CorruptObjectError(
                f"manifest {key} lists invalid ranks {manifest.get('ranks')!r} for round {round_id}."
            )
        return dict(manifest)

    def _cleanup(self, round_id: int) -> None:
        old = round_id - self.keep_rounds
        if old < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.round_dir(old), recursive=True)

    def cleanup_run(self) -> None:
        """Delete everything under this run's prefix (call once, after every replica finished)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.prefix, recursive=True)

    def rounds_present(self) -> list[int]:
        """Round numbers currently stored for this run."""
        return sorted(int(n) for n in self._list(self.key("rounds")) if n.isdigit())


def quantize_fp8(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-tensor absmax fp8 (e4m3): ``q = fp8(t / s)``, ``s = max|t| / 448`` (1 when t = 0).

    The Streaming DiLoCo paper sends 4-bit E3M0 values; like torchft's ``should_quantize`` this
    uses fp8, with float32 accumulation on the receiving side.
    """
    amax = float(t.abs().max()) if t.numel() else 0.0
    scale = amax / FP8_MAX if amax > 0 else 1.0
    return (t.to(torch.float32) / scale).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: float) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` in float32."""
    return q.to(torch.float32) * float(scale)


def _check_round(round_id: int) -> int:
    if not isinstance(round_id, int) or isinstance(round_id, bool) or round_id < 0:
        raise ValueError(f"round_id must be an int >= 0, got {round_id!r}.")
    return round_id


def _protocols(fs: Any) -> set[str]:
    proto = fs.protocol
    return {proto} if isinstance(proto, str) else set(proto)


def _check_layouts(decoded: Mapping[int, _Decoded], ranks: Sequence[int], round_id: int) -> None:
    def shapes(r: int) -> list[tuple[Any, ...]]:
        return [(tuple(e["shape"]), e["dtype"], e["wire"]) for e in decoded[r].meta["layout"]]

    ref_rank = ranks[0]
    ref = shapes(ref_rank)
    for r in ranks[1:]:
        if shapes(r) != ref:
            raise ObjectStoreError(
                f"round {round_id}: rank {r} sent tensors {shapes(r)} but rank {ref_rank} sent {ref}; "
                "every replica must all-reduce the same parameters in the same order (same model, same fragments)."
            )
