"""Object format 4 (the README's "Serverless mode", item 1): one replica's tensors as one self-checking object::

    MAGIC | tag (32) | len(meta) (u32 LE) | len(digest) (u32 LE) | meta | digest | body

``meta``: JSON, ``digest``: XXH3-64 of ``body`` (SHA-256 with an HMAC key), ``tag``: SHA-256 (HMAC-SHA256) of
what lies between the tag and the body. Signed JSON (manifests, markers) carries an ``hmac`` field.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import posixpath
import struct
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
import torch
import xxhash

from .errors import (
    AuthenticationError,
    CorruptObjectError,
    NonFiniteObjectError,
    RoundStats,
    safe_part,
)

MAGIC = b"CDILOCO4"
MAGIC_HMAC = b"CDILOCH4"  # signed
HMAC_KEY_ENV = "COMPOSER_DILOCO_HMAC_KEY"
MIN_HMAC_KEY_BYTES = 16
FP8_MAX = 448.0  # largest finite float8_e4m3fn
S3_PART_BYTES = 50 << 20  # s3fs's multipart part size
S3_PARTS_IN_FLIGHT = 4  # multipart parts uploading at once
_FIRST_POLL_S = 0.001  # first poll delay on a remote store (doubles up to poll_interval_s)
_FIRST_LOCAL_POLL_S = 0.00005  # on a local filesystem
_BLOCK = 512 << 10  # bytes of a tensor hashed and then checked finite while they are in cache
_DIGEST = 32
_LENGTHS = struct.Struct("<II")  # len(meta), len(digest)
_HEAD = len(MAGIC) + _DIGEST + _LENGTHS.size
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)
_DTYPES = {
    name: getattr(torch, name) for name in ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn")
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

Payload = bytes | bytearray | memoryview


@dataclass
class Decoded:
    meta: dict[str, Any]
    tensors: list[torch.Tensor]
    size: int
    tag: bytes = b""  # the object's SHA-256 / HMAC tag, as listed in the manifest


@dataclass
class Encoded:
    """An object ready to write: ``head`` (magic, tag, meta, digest) then ``chunks`` (zero-copy byte
    views of ``wires``, which keep the memory alive)."""

    head: bytes
    chunks: list[memoryview]
    tag: bytes
    wires: Sequence[torch.Tensor] = ()

    @property
    def size(self) -> int:
        return len(self.head) + sum(c.nbytes for c in self.chunks)

    def tobytes(self) -> bytes:
        return b"".join([self.head, *self.chunks])


class Codec:
    """The state of one replica of one run (arguments: :class:`~.protocol.ObjectStoreAllReduce`), its keys
    and its object format."""

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
        hmac_key_env: str = HMAC_KEY_ENV,
        require_hmac: bool = False,
        exchange: Literal["full", "sharded"] = "full",
    ) -> None:
        if exchange not in ("full", "sharded"):
            raise ValueError(f"exchange must be 'full' or 'sharded', got {exchange!r}.")
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
            raise ValueError(f"timeout_s and poll_interval_s must be > 0, got {timeout_s}, {poll_interval_s}")
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
        self.root = root.rstrip("/")
        if any(part in {"..", "."} for part in self.root.split("/")):
            raise ValueError(f"url={url!r} contains '.' or '..' path segments; pass a normalised store root.")
        self.prefix = f"{self.root}/{self.run_id}" if self.root else self.run_id
        self.last = RoundStats()
        self.bytes_written = 0
        self.bytes_read = 0
        self.hmac_key_env = hmac_key_env
        self._mac = read_hmac_key(hmac_key_env, require_hmac)  # keyed HMAC-SHA256, copied per use
        self.exchange = exchange
        # buffers kept across rounds: local reads, float32 accumulators and scratch
        self._buffers: dict[str, bytearray] = {}
        self._acc: list[torch.Tensor] = []
        self._scratch: torch.Tensor | None = None
        kinds = {self.fs.protocol} if isinstance(self.fs.protocol, str) else set(self.fs.protocol)
        self._local, self._memory, self._s3 = "file" in kinds, "memory" in kinds, "s3" in kinds
        self._first_poll_s = _FIRST_LOCAL_POLL_S if self._local else _FIRST_POLL_S
        self._cleaner: ThreadPoolExecutor | None = None  # one worker: deletions run in order
        self._cleanups: list[Future[None]] = []
        self._marker: dict[int, str] | None = None  # this replica's progress marker, as last written
        self._next_round: int | None = None  # the round after the one this instance last completed
        self._proposed: int | None = None  # the round whose manifest this call created
        self._withdrawn: tuple[int, str] | None = None  # (round, reason) this replica refused its payload for
        self.s3_part_bytes = S3_PART_BYTES
        self.s3_parts_in_flight = S3_PARTS_IN_FLIGHT

    def key(self, *parts: str) -> str:
        """A key under the run prefix; every part is validated, the result re-checked."""
        clean = [safe_part("key part", p) for p in parts]
        key = "/".join([self.prefix, *clean])
        if posixpath.normpath(key) != key.rstrip("/") or not key.startswith(self.prefix + "/"):
            raise ValueError(f"key {key!r} escapes the run prefix {self.prefix!r}.")
        return key

    def round_dir(self, round_id: int, *names: str) -> str:
        """Round ``round_id``'s folder, or the key of ``names`` in it."""
        if not isinstance(round_id, int) or isinstance(round_id, bool) or round_id < 0:
            raise ValueError(f"round_id must be an int >= 0, got {round_id!r}.")
        return self.key("rounds", f"{round_id:010d}", *names)

    def object_key(self, round_id: int, rank: int) -> str:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}.")
        return self.round_dir(round_id, f"rank-{rank:05d}.bin")

    def manifest_key(self, round_id: int) -> str:
        return self.round_dir(round_id, "manifest.json")

    def withdrawal_key(self, round_id: int, rank: int) -> str:
        """Replica ``rank``'s record that it refused its own payload for ``round_id``."""
        return self.round_dir(round_id, f"withdrawn-rank-{rank:05d}.json")

    def marker_key(self, rank: int) -> str:
        """Replica ``rank``'s progress marker (manifests it accepted in its latest rounds)."""
        return self.key("progress", f"rank-{rank:05d}.json")

    def _encode(
        self, round_id: int, tensors: Sequence[torch.Tensor], quantize: bool
    ) -> tuple[Encoded, Decoded]:
        """This replica's object for ``round_id`` (fp8 e4m3 + fp32 scale if ``quantize``) and its own
        contribution; NaN/inf is refused before anything is published."""
        forms = [wire_form(t, i, self.rank, round_id, quantize) for i, t in enumerate(tensors)]
        meta = self._meta(round_id, self.rank, quantized=quantize, layout=[entry for _, entry, _ in forms])
        enc = self._pack(meta, [wire for wire, _, _ in forms], check_finite=not quantize)
        return enc, Decoded(meta, [own for *_, own in forms], enc.size, enc.tag)

    def _meta(self, round_id: int, rank: int, **extra: Any) -> dict[str, Any]:
        return {"run_id": self.run_id, "round": round_id, "rank": rank, "world_size": self.world_size} | extra

    def _pack(
        self, meta: dict[str, Any], wires: Sequence[torch.Tensor], *, check_finite: bool = False
    ) -> Encoded:
        """Header (with the body's digest) + zero-copy views of the wire tensors; with ``check_finite``,
        NaN/inf is refused in the digest's pass (:func:`_scan`)."""
        chunks = [bytes_view(w) for w in wires]
        for entry, chunk in zip(meta["layout"], chunks):
            entry["nbytes"] = chunk.nbytes
        meta_bytes = json.dumps(meta).encode()
        digest, bad = _scan(self._mac is not None, list(zip(chunks, wires)), check_finite)
        if bad is not None:
            raise non_finite(bad, meta["rank"], meta["round"])
        lead = _LENGTHS.pack(len(meta_bytes), len(digest)) + meta_bytes + digest
        tag = self._sign(lead)
        return Encoded((MAGIC_HMAC if self._mac is not None else MAGIC) + tag + lead, chunks, tag, wires)

    def _sign(self, data: bytes | memoryview) -> bytes:
        """HMAC-SHA256 of ``data`` under the run's key; SHA-256 without a key."""
        if self._mac is None:
            return hashlib.sha256(data).digest()
        mac = self._mac.copy()
        mac.update(data)
        return mac.digest()

    def _damaged(self, key: str, size: int, what: str) -> CorruptObjectError:
        if self._mac is not None:
            return AuthenticationError(
                f"object {key} fails its HMAC-SHA256 check ({what}, {size} bytes): signed with a "
                f"different ${self.hmac_key_env}, or altered/truncated after signing."
            )
        return CorruptObjectError(
            f"object {key} fails its checksum ({what}, {size} bytes: truncated or corrupt)."
        )

    def _check_header(self, view: memoryview, key: str) -> None:
        magic = bytes(view[: len(MAGIC)])
        if magic[:-1] in (MAGIC[:-1], MAGIC_HMAC[:-1]) and magic[-1:] in (b"1", b"2", b"3"):
            raise CorruptObjectError(
                f"object {key} is in object format {magic[-1:].decode()} of an older composer-diloco; "
                "this version reads format 4 only. Run every replica of a run with the "
                "same composer-diloco version (an upgraded run needs a new run_id)."
            )
        if len(view) < _HEAD or magic not in (MAGIC, MAGIC_HMAC):
            raise CorruptObjectError(f"object {key} has no composer-diloco header (partial or foreign write)")
        if (magic == MAGIC_HMAC) != (self._mac is not None):
            raise self._unverifiable(f"object {key}", signed=magic == MAGIC_HMAC)

    def _unverifiable(self, what: str, *, signed: bool) -> AuthenticationError:
        """``what`` is signed and this replica has no key, or unsigned and this replica has one."""
        env = self.hmac_key_env
        if signed:
            return AuthenticationError(
                f"{what} is HMAC-signed but ${env} is not set on this replica, which cannot verify it: "
                "give every replica the same secret."
            )
        return AuthenticationError(
            f"{what} is unsigned, not authenticated (written without ${env}); this replica has ${env} set "
            "and refuses it: give every replica the same secret."
        )

    def _verify(self, data: Payload, key: str) -> tuple[dict[str, Any], memoryview, bytes, memoryview]:
        """Check the header, the tag and the body's length; return (meta, body, tag, the listed digest)."""
        view = memoryview(data)
        view = view if view.format == "B" else view.cast("B")
        self._check_header(view, key)
        tag = bytes(view[len(MAGIC) : len(MAGIC) + _DIGEST])
        meta_len, digest_len = _LENGTHS.unpack_from(view, _HEAD - _LENGTHS.size)
        end = _HEAD + meta_len + digest_len
        if end > len(view) or not hmac.compare_digest(self._sign(view[_HEAD - _LENGTHS.size : end]), tag):
            raise self._damaged(key, len(view), "header")
        try:
            meta = json.loads(bytes(view[_HEAD : _HEAD + meta_len]))
            sizes = [int(e["nbytes"]) for e in meta["layout"]]
            if min(sizes, default=0) < 0:
                raise ValueError(f"nbytes={sizes}")
        except (ValueError, KeyError, TypeError) as exc:  # tag matched: a foreign/garbage writer
            raise CorruptObjectError(f"object {key} does not decode: {exc}") from exc
        body = view[end:]
        if sum(sizes) != len(body):
            raise self._damaged(key, len(view), f"body of {len(body)} bytes, its header lists {sum(sizes)}")
        return meta, body, tag, view[_HEAD + meta_len : end]

    def decode(
        self,
        data: Payload,
        *,
        round_id: int,
        rank: int,
        key: str = "?",
        expect: Mapping[str, Any] | None = None,
    ) -> Decoded:
        """Validate and deserialise an object; raise :class:`CorruptObjectError` naming ``key``
        (:class:`AuthenticationError` for a missing/wrong HMAC, :class:`NonFiniteObjectError`
        for NaN/inf values)."""
        meta, body, tag, digest = self._verify(data, key)
        quantized = bool(meta.get("quantized"))
        try:
            parts, tensors = _tensors(meta, body)
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
            raise CorruptObjectError(f"object {key} has an invalid tensor layout: {exc}") from exc
        got, bad = _scan(self._mac is not None, parts, not quantized)
        if got != digest:
            raise self._damaged(key, len(data), f"body bytes 0-{len(body)}")
        if meta.get("exchange", "full") != self.exchange:
            raise CorruptObjectError(
                f"object {key} was written by a replica with exchange={meta.get('exchange', 'full')!r}, "
                f"this one uses exchange={self.exchange!r}: every replica of a run must use the same."
            )
        for name, want in {**self._meta(round_id, rank), **(expect or {})}.items():
            if meta.get(name) != want:
                raise CorruptObjectError(f"object {key} has {name}={meta.get(name)!r}, expected {want!r}.")
        if quantized:
            bad = next((i for i, t in enumerate(tensors) if not all_finite(t)), None)
        if bad is not None:
            raise NonFiniteObjectError(
                f"object {key} passes its checksum but tensor {bad} holds NaN/inf; it is never "
                "averaged (a replica with a diverged inner loop, or a foreign writer)."
            )
        return Decoded(meta, tensors, len(data), tag)

    def _dump_json(self, obj: dict[str, Any]) -> bytes:
        if self._mac is not None:
            obj = {**obj, "hmac": self._sign(_canonical(obj)).hex()}
        return json.dumps(obj, sort_keys=True).encode()

    def _load_json(self, raw: bytes, key: str) -> dict[str, Any]:
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict):
                raise TypeError(f"a JSON {type(obj).__name__}, not an object")
        except (ValueError, TypeError) as exc:
            raise CorruptObjectError(f"{key} is not valid JSON of this run: {exc}") from exc
        mac = obj.pop("hmac", None)
        if (mac is not None) != (self._mac is not None):
            raise self._unverifiable(key, signed=mac is not None)
        if mac is not None and not hmac.compare_digest(
            str(mac).encode(), self._sign(_canonical(obj)).hex().encode()
        ):
            raise AuthenticationError(
                f"{key} is wrongly signed: this replica has ${self.hmac_key_env} set and refuses it (signed with "
                "a different secret, or altered)."
            )
        return obj


def _tensors(
    meta: Mapping[str, Any], body: memoryview
) -> tuple[list[tuple[memoryview, torch.Tensor]], list[torch.Tensor]]:
    """The (bytes, tensor) parts ``meta``'s layout places in ``body`` and the tensors they stand for."""
    parts: list[tuple[memoryview, torch.Tensor]] = []
    tensors: list[torch.Tensor] = []
    offset = 0
    for entry in meta["layout"]:
        wire, dtype = _DTYPES.get(entry["wire"]), _DTYPES.get(entry["dtype"])
        shape = [int(d) for d in entry["shape"]]
        nbytes = int(entry["nbytes"])
        if wire is None or dtype is None:
            raise ValueError(f"unknown dtype {entry['wire']!r}/{entry['dtype']!r}")
        if nbytes != math.prod(shape) * wire.itemsize or offset + nbytes > len(body):
            raise ValueError(f"tensor of shape {shape} cannot occupy {nbytes} bytes at offset {offset}")
        raw = frombuffer(body, nbytes, offset, wire)
        t = raw if len(shape) == 1 else raw.view(shape)
        parts.append((body[offset : offset + nbytes], t))
        tensors.append(dequantize_fp8(t, float(entry["scale"])) if meta.get("quantized") else t)
        offset += nbytes
    if offset != len(body):
        raise ValueError(f"{len(body) - offset} trailing bytes beyond the layout")
    return parts, tensors


def _scan(
    signed: bool, parts: Sequence[tuple[memoryview, torch.Tensor]], check: bool
) -> tuple[bytes, int | None]:
    """One read of a body's (bytes, tensor) parts: its checksum (SHA-256 if signed, else XXH3-64) and, with
    ``check``, the index of the first part holding NaN/inf (None if none), each block checked while in cache."""
    h: Any = hashlib.sha256() if signed else xxhash.xxh3_64()
    bad: int | None = None
    for i, (view, t) in enumerate(parts):
        if not check or bad is not None:
            h.update(view)
            continue
        flat, size = t.reshape(-1), t.element_size()
        step = _BLOCK // size
        for lo in range(0, flat.numel(), step):
            h.update(view[lo * size : (lo + step) * size])
            if bad is None and not all_finite(flat[lo : lo + step]):
                bad = i
    return bytes(h.digest()), bad


def non_finite(i: int, rank: int, round_id: int) -> ValueError:
    return ValueError(
        f"tensor {i} of rank {rank} in round {round_id} holds NaN/inf; refusing to publish "
        "it (it would poison every replica's average). Check the inner optimiser / loss."
    )


def wire_form(
    t: object, i: int, rank: int, round_id: int, quantize: bool
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
    """(wire tensor, layout entry, this replica's own contribution) of tensor ``i`` (no copy of a
    contiguous CPU tensor)."""
    if not isinstance(t, torch.Tensor) or not torch.is_floating_point(t):
        raise ValueError(f"tensor {i} must be a floating-point torch.Tensor, got {type(t).__name__}.")
    plain = t.is_cpu and not t.requires_grad and t.is_contiguous()
    host = t if plain else t.detach().to("cpu").contiguous()
    if quantize and not all_finite(host):
        raise non_finite(i, rank, round_id)
    entry: dict[str, Any] = {
        "shape": list(host.shape),
        "dtype": _DTYPE_NAMES.get(host.dtype) or str(host.dtype)[6:],
    }
    if quantize:
        q, scale = quantize_fp8(host)
        entry.update(wire="float8_e4m3fn", scale=scale)
        return q, entry, dequantize_fp8(q, scale)
    entry.update(wire=entry["dtype"], scale=None)
    return host, entry, host


def all_finite(t: torch.Tensor) -> bool:
    """A finite sum proves every value finite; only otherwise are the values checked one by one."""
    if t.numel() == 0:
        return True
    if t.dtype == torch.float8_e4m3fn:
        t = t.to(torch.float32)
    if math.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).item()):
        return True
    return bool(torch.isfinite(t).all())


def bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in row-major order: a view of its memory when it is contiguous."""
    if t.numel() == 0:
        return memoryview(b"")
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype not in _NUMPY_DTYPES:  # bfloat16, float8: numpy has no such dtype, its bytes do
        t = t.reshape(-1).view(torch.uint8)
    array: Any = t.numpy()
    return memoryview(array).cast("B")


def frombuffer(buf: memoryview, nbytes: int, offset: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """``nbytes`` bytes of ``buf`` from ``offset`` as a 1-D ``dtype`` tensor over that memory, no copy."""
    if not nbytes:
        return torch.empty(0, dtype=dtype)
    count = nbytes // dtype.itemsize
    if not buf.readonly:
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    with warnings.catch_warnings():  # read-only bytes: these tensors are only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def quantize_fp8(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-tensor absmax fp8 (e4m3): ``q = fp8(t / s)``, ``s = max|t| / 448`` (1 when t = 0), as torchft's
    ``should_quantize`` (the Streaming DiLoCo paper sends 4-bit E3M0)."""
    amax = float(t.abs().max()) if t.numel() else 0.0
    scale = amax / FP8_MAX if amax > 0 else 1.0
    return (t.to(torch.float32) / scale).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: float) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` in float32."""
    return q.to(torch.float32) * float(scale)


def read_hmac_key(env: str, required: bool) -> hmac.HMAC | None:
    """An HMAC-SHA256 keyed with the shared secret from ``$env``: its repr never shows the key and it
    cannot be pickled (every replica reads the key from its own environment)."""
    if not isinstance(env, str) or not env:
        raise ValueError(f"hmac_key_env must name an environment variable, got {env!r}.")
    secret = os.environ.get(env, "")
    if not secret:
        if required:
            raise ValueError(
                f"require_hmac=True but ${env} is not set: export the run's shared secret "
                f"(at least {MIN_HMAC_KEY_BYTES} bytes) on every replica."
            )
        return None
    key = secret.encode()
    if len(key) < MIN_HMAC_KEY_BYTES:
        raise ValueError(
            f"${env} is set but shorter than {MIN_HMAC_KEY_BYTES} bytes: use a random secret of at "
            "least 32 bytes (e.g. `openssl rand -hex 32`)."
        )
    return hmac.new(key, digestmod=hashlib.sha256)


def _canonical(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
