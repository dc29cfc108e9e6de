"""ObjectStoreAllReduce: an all-reduce through any fsspec filesystem, with no network path
between replicas (``file://``, ``memory://``, ``s3://``, ``gs://``, …).

The invariant: **every replica that completes round r applies the same average, or fails with an
error naming why.** The round's committed manifest is its single source of truth. One exchange
("round") works like this, for replica ``rank`` of ``world_size``:

1. If round r already has a manifest (a replica re-running a committed round, or a straggler the
   round went on without), adopt it: average exactly the objects it lists, never this replica's
   new values. If it has none but the run has evidently moved past r (a progress marker of some
   replica accepted r or a later round, or a later round exists), the committed result is gone:
   raise :class:`RoundExpiredError` (restart from a checkpoint). Nothing is written then.
   A replica *in step* (this instance completed round r - 1 and calls round r) has nothing of
   round r yet, so this check rides on the later steps instead of costing requests up front:
   its object goes up first, a committed manifest makes its proposal lose and is read back
   (step 4) or is seen in the listing (step 3), a later round in the listing sends it to the
   check above, and a replica's marker that went on from r under another manifest names the
   round expired (step 5). On :class:`RoundExpiredError` the replica deletes what it wrote into
   r (its objects, a manifest it proposed) and takes back its marker entry.
2. Encode the tensors (optionally fp8-quantised) into one object with a magic header, an XXH3-64
   per piece of at most 4 MiB of each tensor and a tag = SHA-256 of the header and that table (with
   a shared secret from ``$COMPOSER_DILOCO_HMAC_KEY``: SHA-256 per piece and HMAC-SHA256; see
   :meth:`ObjectStoreAllReduce.encode`). Why XXH3-64: the two whole-body SHA-256 passes took
   longer than writing the object, and CRC-32 (format 2) still cost more than a page-cache read;
   XXH3-64 runs at about 9 GB/s per core (4x zlib's CRC-32, 10x SHA-256), in threads over the
   pieces where each replica has 2 cores to itself (``checksum_parallel``), and lets a random
   corruption through with probability 2^-64; forged objects are the HMAC's job. Objects of
   formats 1 and 2 are refused by name. Then *create* ``<root>/<run_id>/rounds/<round>/rank-<rank>.bin`` with a create-only write
   (``link`` of a complete temporary file on local filesystems, written piece by piece as it is
   hashed, its header last, the file made ahead in ``<run_id>/tmp/`` after the previous round;
   ``If-None-Match: *`` on S3, a lock on ``memory://``). Objects are immutable: a replica whose object for r exists already (it
   re-runs r after a crash) contributes the stored object, which others may have read.
3. Read the other ranks' objects: first directly (on S3 all GETs at once, no listing), then by
   polling a listing of the run's rounds (on Linux a local wait from the third poll on ends when a file is
   linked into the round's folder: an inotify watch). Every object is decoded and validated (magic, tag, run
   id, round, rank, world size, tensor layout, finite values); a partial, corrupt, non-finite or
   unauthenticated object is never averaged.
4. When every rank is present, or when ``timeout_s`` passes, the replica proposes the participant
   set by *creating* ``manifest.json`` (create-only, as above) listing the ranks and the tag of
   each rank's object (with every rank present on an object store, the lowest rank proposes and the
   others first read its manifest for a few polls: a losing create-only PUT costs more than a GET; on
   a local filesystem every replica proposes at once: a losing link and one read cost less than one
   poll's sleep). The first proposal wins;
   every replica, including a late one, averages exactly those objects (tags checked). On timeout,
   ``on_timeout="proceed"`` goes on with the replicas present (at least ``min_replicas``);
   ``"fail"`` raises :class:`StragglerTimeoutError`.
5. Before applying, the replica records the manifest's fingerprint for round r in its progress
   marker ``progress/rank-<rank>.json``, then reads every replica's marker: a marker that accepted
   a different manifest for r (one was deleted and proposed again) raises
   :class:`RoundConflictError`. Of two replicas accepting different manifests, at least one sees
   the other's marker, so no two replicas complete r with different averages.
6. Average in float32 in rank order (``Σ x_r`` then ``/ n``, the order torchft's gloo path
   uses), write into the caller's tensors; one participant per round (``ranks[r % n]``) deletes
   the rounds older than ``keep_rounds`` in the background. On a local filesystem a worker of each
   replica then makes the next round's temporary files (a file's creation is a journaled metadata
   operation: off the round's path), and a marker is swapped in by ``renameat2(RENAME_EXCHANGE)``
   with the old one where the filesystem has it (``os.replace`` elsewhere).

With ``exchange="sharded"`` step 2 writes k shard objects (shard s = the s-th 1/k of every flattened
tensor, under a fresh nonce) and then the replica's *index* object (at the key above; its tag is what
the manifest lists); after step 4, participant j of n reduces the shards s with ``s % n == j`` (reads
shard s of every participant, tags checked against the committed indexes) and *creates*
``reduced-<s>.bin``; every replica then reads the k reduced shards. A shard whose reducer is silent
for ``timeout_s`` is reduced by the waiting replica (create-only: the first writer wins, everyone
applies the stored shard). Bytes read per replica per round: about 2 (k−1)/k × the payload, against
(k−1)× in the full exchange.

Every key is built from validated parts and checked to stay under ``<root>/<run_id>/``. The HMAC
secret is read once from the environment and never logged or put in an error message.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import hashlib
import hmac
import io
import json
import logging
import math
import mmap
import os
import posixpath
import re
import select
import socket
import sys
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import fsspec
import fsspec.asyn
import torch
import xxhash
from torch._C._nn import flatten_dense_tensors, unflatten_dense_tensors

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

MAGIC = b"CDILOCO3"  # object format 3: XXH3-64 per chunk, SHA-256 over header + table (integrity)
MAGIC_HMAC = b"CDILOCH3"  # format 3 signed: SHA-256 per chunk, HMAC-SHA256 over header + table (authenticity)
_OLD_FORMATS = {  # refused by name: an upgraded run needs a new run_id
    b"CDILOCO1": "1 (whole-body SHA-256)",
    b"CDILOCH1": "1 (whole-body SHA-256)",
    b"CDILOCO2": "2 (CRC-32 per chunk)",
    b"CDILOCH2": "2 (signed)",
}
HMAC_KEY_ENV = "COMPOSER_DILOCO_HMAC_KEY"
MIN_HMAC_KEY_BYTES = 16
CHUNK_BYTES = 4 << 20  # the body is checked in pieces of at most this many bytes (per tensor)
_DIGEST = 32
_HEAD = len(MAGIC) + _DIGEST + 8  # magic, tag, len(meta) and len(table) as 4-byte little-endian ints
_POOL: ThreadPoolExecutor | None = None  # chunk checksums (xxhash/hashlib release the GIL)
_POOL_LOCK = threading.Lock()
S3_PART_BYTES = 50 << 20  # s3fs's part size: objects of 2 parts or more go up as parallel multipart uploads
S3_PARTS_IN_FLIGHT = 4  # multipart parts uploading at once (each streamed from the tensors' memory)
# Up to this size an S3 PUT body is one joined bytes object, above it a stream from the tensors' memory:
# botocore sends a streamed body behind `Expect: 100-continue`, a round trip before the body (on moto
# 8-10 ms a PUT, half of a 1 MiB PUT's time; even at 4 MiB the two are level).
S3_JOINED_PUT_BYTES = 2 << 20
_STREAM_READ = 1 << 20  # S3 GET bodies are copied into the read buffer this many bytes at a time
# float32 elements (512 KiB) of the scratch a full-exchange average goes through: the piece, summed, is read once
# more by its overflow check while it is still in L2 (1 MiB pieces were 1.1x slower per 64 MiB with the check)
_REDUCE_PIECE = 1 << 17
_BUCKET_TENSOR = 1 << 15  # float32 targets up to this many elements are averaged several at a time
_PARALLEL_BYTES = 8 << 20  # smaller payloads are checked in the calling thread
# a local object of this many bytes or more is mapped, a smaller one read into a buffer kept across rounds: mapping
# 1 MiB, then hashing and checking it, cost 85 µs against 56 read; 2 MiB 89 against 110 (AMD EPYC VM, ext4)
_MAP_MIN = 2 << 20
# cleanup_run empties the run's folders again this many times when a file appears in one as it is emptied (another
# replica's worker making its files ahead; that worker makes no folder of the run, so it soon stops)
_RUN_REMOVALS = 5
# a local replica's wait for another's file is watched (inotify) from this poll delay on (the third wait): earlier
# waits sleep (see ObjectStoreAllReduce._pause)
_WATCH_FROM_S = 2e-4
_WRITE_BUFFER = 1 << 16  # a local object's write buffer (heap memory, reused: not a fresh mapping per file)
# local objects of at least _PREFILL_MIN bytes, up to _PREFILL_BYTES a round in all, go into temporary files that the
# background worker filled with as many zeros ahead (see _prefill): overwriting page-cache pages costs ~30 µs a MiB on
# ext4, writing a new file's ~175 µs (page and block allocation), a third of a 1 MiB object's publish
_PREFILL_MIN = 1 << 16
_PREFILL_BYTES = 8 << 20
_SCAN_BYTES = 1 << 20  # a chunk is hashed, then checked for NaN/inf, this many bytes at a time (in cache)
# tensors below this size are checked for NaN/inf in runs of up to _SCAN_BYTES per dtype, one reduction a run: a
# check's fixed cost (~3 µs: a view, a sum, a host read) exceeds summing 64 KiB
_RUN_CHECK_BYTES = 64 << 10
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_MEMORY_LOCK = threading.Lock()
_FIRST_POLL_S = 0.001  # polls of a remote store start here and double up to poll_interval_s
_FIRST_LOCAL_POLL_S = 0.00005  # a local listing costs tens of µs: a 1 MiB round must not wait out 1 ms sleeps
_PROPOSAL_LOOKS = 4  # reads of the manifest rank min(ranks) proposes, before the others propose too
_CLEANUPS_QUEUED = 2  # deletions allowed to wait behind the running one before a round waits for them
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)
_DTYPES = {
    name: getattr(torch, name) for name in ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn")
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class ObjectStoreError(RuntimeError):
    """An exchange through the object store could not complete."""


class StragglerTimeoutError(ObjectStoreError, TimeoutError):
    """Some replicas did not deliver a valid object for a round within ``timeout_s``."""


class CorruptObjectError(ObjectStoreError, ValueError):
    """An object in the store is truncated, corrupt, or belongs to another run/round/rank."""


class NonFiniteObjectError(CorruptObjectError):
    """An object passes its checksum but holds NaN/inf values (never averaged)."""


class NonFiniteResultError(ObjectStoreError, ValueError):
    """Every contribution of a round is finite but their sum (``op="sum"``) is beyond float32: no replica
    applies it, none changes."""


class AuthenticationError(CorruptObjectError):
    """An object, manifest or marker is unauthenticated or fails its HMAC-SHA256 check."""


class RoundExpiredError(ObjectStoreError):
    """Round r was committed but its result is no longer in the store (cleaned up, or its
    manifest or objects deleted): this replica must restart from a checkpoint."""


class RoundConflictError(ObjectStoreError):
    """Replicas accepted different manifests for one round (a manifest was deleted and proposed
    again): the run can no longer guarantee identical replicas."""


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
    """What the last round did (for logs, tests and the benchmark).

    ``phases``: seconds per phase, in the round's order, each timed from the end of the one before (together
    they are the round's ``seconds`` but for the hand-off of old rounds to the deletion worker):

    - ``publish``: encode this replica's tensors and create its object (sharded: its shards and index); 0 when
      the round was committed already;
    - ``commit``: the committed-round check, then wait for and validate the other replicas' objects until the
      round's manifest is committed (a straggler's wait is here);
    - ``reduce``: read what the manifest lists and compute the result before anything is applied (full
      exchange: the checks and the staged sums; sharded: reduce this replica's shards, read the reduced ones);
    - ``accept``: write this replica's progress marker, read the others';
    - ``apply``: write the result into the caller's tensors (full exchange: the average, piece by piece).
    """

    round: int = -1
    participants: list[int] = field(default_factory=list)
    excluded: dict[int, str] = field(default_factory=dict)
    bytes_written: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    adopted: bool = False  # this replica's new values were not its contribution (see allreduce)
    phases: dict[str, float] = field(default_factory=dict)


PHASES = ("publish", "commit", "reduce", "accept", "apply")  # RoundStats.phases, in a round's order


class _Laps:
    """A round's :data:`PHASES` timed back to back: each call adds the time since the previous one."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.phases = dict.fromkeys(PHASES, 0.0)

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] += now - self._last
        self._last = now


@dataclass
class _Decoded:
    meta: dict[str, Any]
    tensors: list[torch.Tensor]
    size: int
    tag: bytes = b""  # the object's SHA-256 / HMAC tag, as listed in the manifest


@dataclass
class _Unsealed:
    """What an object's header still needs: its checksum table, computed as the body is written
    (:meth:`ObjectStoreAllReduce._seal`)."""

    meta: dict[str, Any]
    meta_bytes: bytes
    pieces: list[tuple[int, memoryview]]  # (tensor index, view) of at most CHUNK_BYTES: one checksum each
    dtypes: list[torch.dtype | None]  # per tensor, what its pieces are checked for NaN/inf as


@dataclass
class _Encoded:
    """An object ready to write: ``head`` (magic, tag, meta) then ``chunks`` (zero-copy byte views
    of ``wires``, which keep the memory alive). While ``unsealed``, ``head`` is a placeholder of the
    header's length and ``tag`` is empty: writing the body seals it."""

    head: bytes
    chunks: list[memoryview]
    tag: bytes
    wires: Sequence[torch.Tensor] = ()
    unsealed: _Unsealed | None = None

    @property
    def size(self) -> int:
        return len(self.head) + sum(c.nbytes for c in self.chunks)

    def tobytes(self) -> bytes:
        assert self.unsealed is None, "an unsealed object has no header yet"
        return b"".join([self.head, *self.chunks])


Payload = bytes | bytearray | memoryview


@dataclass
class _Manifest:
    ranks: list[int]
    tags: dict[int, bytes]
    fingerprint: str  # SHA-256 of the manifest's bytes, recorded in progress markers


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
        poll_interval_s: the longest delay between listings of the round folder (polling starts
            at 50 µs on a local filesystem and 1 ms elsewhere and doubles up to this, so small
            payloads are not dominated by sleeps).
        exchange: ``"full"`` (every replica reads every replica's whole object: bytes read per
            replica grow as (k−1)× the payload) or ``"sharded"`` (reduce-scatter then all-gather
            through the store: each replica reduces 1/k of the tensors and reads about 2× the
            payload per round whatever k; see the module docstring). Every replica of a run must
            use the same; objects of the other kind are refused.
        storage_options: passed to ``fsspec.url_to_fs`` (e.g. ``key``/``secret``/``client_kwargs``).
        hmac_key_env: the environment variable holding the shared HMAC secret (at least
            16 bytes). When it is set, objects, manifests and markers are signed with
            HMAC-SHA256 and unsigned or wrongly signed ones are refused
            (:class:`AuthenticationError`); every replica must then have the same secret.
        require_hmac: raise at construction if ``hmac_key_env`` is not set.
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
        self.hmac_key_env = hmac_key_env
        secret = _hmac_key(hmac_key_env, require_hmac)
        self._hmac = None if secret is None else _Secret(secret)
        self.exchange = exchange
        self._buffers: dict[str, bytearray] = {}  # read buffers reused across rounds (local stores)
        self._acc: list[torch.Tensor] = []  # float32 accumulators reused across rounds
        self._scratch: torch.Tensor | None = None  # the direct average's float32 piece, kept across rounds
        # a local filesystem's paths are the OS's: small reads and listings skip fsspec
        self._local = "file" in _protocols(self.fs)
        self._memory = "memory" in _protocols(self.fs)  # create-only emulated under a process-wide lock
        self._first_poll_s = _FIRST_LOCAL_POLL_S if self._local else _FIRST_POLL_S
        self._cleaner: ThreadPoolExecutor | None = None  # one worker: deletions run one at a time, in order
        self._cleanups: list[Future[None]] = []
        self._marker: dict[int, str] | None = None  # this replica's progress marker, as last written
        # local stores: temporary files created ahead (see _make_spares), removed with the store at the latest
        self._tmp_dir = self.key("tmp")
        self._spares: list[tuple[str, io.BufferedWriter]] = []
        self._tmp_taken = 0  # temporary files the current round took: the next round gets as many spares
        # (temporary name, file, bytes of zeros it holds) made ahead for objects (see _prefill); the sizes of the
        # objects the current round wrote, which the next round's get
        self._filled: list[tuple[str, io.BufferedWriter, int]] = []
        self._fill_sizes: list[int] = []
        self._exchange = True  # until this filesystem refuses RENAME_EXCHANGE (see _swap_in)
        self._sparer: ThreadPoolExecutor | None = None  # the worker that makes them
        self._sparing: Future[None] | None = None
        self._trash: list[str] = []  # spent temporary names the worker deletes (see _drop_name)
        self._pid = os.getpid()  # the process they belong to
        weakref.finalize(self, _drop_spares, self._spares, self._filled, self._trash, self._pid)
        self._watch: _FolderWatch | None = None  # local stores on Linux: wakes waits for another's file
        self._watch_pid = 0  # the process it belongs to
        self._next_round: int | None = None  # the round after the one this instance last completed
        self._proposed: int | None = None  # the round whose manifest this call created (see _discard)
        self._machine = _machine()  # what this replica's objects say of where they come from
        # replicas of the last round on this machine, this one included (see checksum_parallel)
        self.colocated = 1
        self.s3_part_bytes = S3_PART_BYTES  # multipart part size on S3 (parts go up in parallel)
        self.s3_parts_in_flight = S3_PARTS_IN_FLIGHT  # multipart parts uploading at once
        # s3fs's cat_file sends a HEAD (size) before each GET unless max_concurrency=1, and its concurrent
        # ranged read joins the parts into two more full copies: one GET per object (see the README)
        self._cat_options: dict[str, Any] = {"max_concurrency": 1} if _is_s3(self.fs) else {}

    @property
    def authenticated(self) -> bool:
        """True when objects are signed and verified with HMAC-SHA256."""
        return self._hmac is not None

    @property
    def checksum_parallel(self) -> bool:
        """Whether objects are hashed and checked in the process's checksum threads (payloads of 8 MiB and
        more): only with at least 2 cores per replica on this machine, counted as the cores this process may
        use over :attr:`colocated`, the replicas of the last round whose objects came from this machine (1
        before the first round). Replicas that share cores lose more to thread switching than the threads
        overlap: two replica processes on 2 cores took 59 ms for a 64 MiB round with the checksums in the
        calling thread against 67 ms in the threads, while one replica alone publishes 64 MiB in 18 ms with
        them against 26 ms without."""
        return _usable_cores() // self.colocated >= 2

    @property
    def _hmac_key(self) -> bytes | None:
        return None if self._hmac is None else self._hmac.value

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

    def marker_key(self, rank: int) -> str:
        """Replica ``rank``'s progress marker (manifests it accepted in its latest rounds)."""
        return self.key("progress", f"rank-{rank:05d}.json")

    # ---- codec ------------------------------------------------------------------------
    def encode(self, round_id: int, tensors: Sequence[torch.Tensor], *, quantize: bool = False) -> bytes:
        """Serialise this replica's tensors for ``round_id`` (fp8 e4m3 + fp32 scale if ``quantize``).

        Layout (object format 3)::

            MAGIC | tag (32) | len(meta) (u32 LE) | len(table) (u32 LE) | meta | table | body

        ``meta`` is JSON (run, round, rank, world size, per-tensor dtype/shape/scale/nbytes, chunk
        size), ``body`` the raw tensor bytes, ``table`` one checksum per piece of at most
        ``meta["chunk"]`` bytes of each tensor: XXH3-64 (8 bytes, big-endian) by default, SHA-256 (32 bytes)
        with an HMAC key. ``tag`` = SHA-256, or HMAC-SHA256 with the key, of everything between
        the tag and the body. No pickle: decoding is ``torch.frombuffer`` on validated offsets.
        """
        return self._encode(round_id, tensors, quantize)[0].tobytes()

    def _encode(
        self, round_id: int, tensors: Sequence[torch.Tensor], quantize: bool, *, stream: bool = False
    ) -> tuple[_Encoded, _Decoded]:
        """(the object, this replica's contribution as decoded). ``stream``: leave the object unsealed, its
        checksums computed as a local create writes it (the contribution's tag is set then, :meth:`_publish`)."""
        own: list[torch.Tensor] = []
        layout: list[dict[str, Any]] = []
        wires: list[torch.Tensor] = []
        for i, t in enumerate(tensors):
            _host, wire, entry, mine = _wire_form(t, i, self.rank, round_id, quantize)
            layout.append(entry)
            wires.append(wire)
            own.append(mine)
        meta = self._meta(round_id, self.rank, quantized=quantize, layout=layout, machine=self._machine)
        enc = self._pack(meta, wires, stream=stream)
        return enc, _Decoded(meta, own, enc.size, enc.tag)

    def _meta(self, round_id: int, rank: int, **extra: Any) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "round": round_id,
            "rank": rank,
            "world_size": self.world_size,
            **extra,
        }

    def _pack(
        self, meta: dict[str, Any], wires: Sequence[torch.Tensor], *, check: bool = True, stream: bool = False
    ) -> _Encoded:
        """Header (with the checksum table) + zero-copy views of the wire tensors: the checksums
        are computed over the tensors' own memory, chunk by chunk (in parallel threads on large
        payloads), each piece checked for NaN/inf right after it is hashed (``check``; a quantized
        wire was checked before quantizing); no joined copy of the payload is ever made here.
        ``stream``: the object is returned unsealed, for a local create to hash each piece right
        before writing it (:meth:`_seal`), so the payload is read from memory once."""
        chunks = [_bytes_view(w) for w in wires]
        for entry, chunk in zip(meta["layout"], chunks):
            entry["nbytes"] = chunk.nbytes
        meta["chunk"] = CHUNK_BYTES
        meta_bytes = json.dumps(meta).encode()
        # a full-precision wire's values are checked for NaN/inf as they are hashed (one read from memory)
        checked = [None if meta.get("quantized") or not check else w.dtype for w in wires]
        pieces = _pieces(chunks, CHUNK_BYTES)
        table_bytes = len(pieces) * _Hasher.width(self._signed)
        placeholder = bytes(len(MAGIC) + _DIGEST + 8 + len(meta_bytes) + table_bytes)
        enc = _Encoded(placeholder, chunks, b"", wires, _Unsealed(meta, meta_bytes, pieces, checked))
        if not stream:
            self._seal(enc)
        return enc

    def _seal(self, enc: _Encoded, write: Callable[[memoryview], object] | None = None) -> None:
        """Compute ``enc``'s checksum table and header; with ``write``, each piece is passed to it right
        after it is hashed and checked (:func:`_scan`; small tensors are checked together after their write).
        Raises on a non-finite value before the object is complete: the caller never publishes it."""
        pending = enc.unsealed
        assert pending is not None
        table, finite = _scan(self._signed, pending.pieces, pending.dtypes, write, self.checksum_parallel)
        if False in finite:
            raise _non_finite(finite.index(False), pending.meta["rank"], pending.meta["round"])
        lead = _u32(len(pending.meta_bytes)) + _u32(len(table)) + pending.meta_bytes + table
        enc.tag = self._tag(lead)
        enc.head = (MAGIC_HMAC if self._hmac_key is not None else MAGIC) + enc.tag + lead
        enc.unsealed = None

    @property
    def _signed(self) -> bool:
        return self._hmac_key is not None

    def _tag(self, lead: bytes | memoryview) -> bytes:
        if self._hmac_key is None:
            return hashlib.sha256(lead).digest()
        return hmac.new(self._hmac_key, lead, hashlib.sha256).digest()

    def _damaged(self, key: str, size: int, what: str) -> CorruptObjectError:
        if self._hmac_key is not None:
            return AuthenticationError(
                f"object {key} fails its HMAC-SHA256 check ({what}, {size} bytes): signed with a "
                f"different ${self.hmac_key_env}, or altered/truncated after signing."
            )
        return CorruptObjectError(
            f"object {key} fails its checksum ({what}, {size} bytes: truncated or corrupt)."
        )

    def _check_header(self, view: memoryview, key: str) -> None:
        magic = bytes(view[: len(MAGIC)])
        if magic in _OLD_FORMATS:
            raise CorruptObjectError(
                f"object {key} is in object format {_OLD_FORMATS[magic]}, written by an older "
                "composer-diloco; this version reads format 3 only. Run every replica of a run with the "
                "same composer-diloco version (an upgraded run needs a new run_id)."
            )
        if len(view) < _HEAD or magic not in (MAGIC, MAGIC_HMAC):
            raise CorruptObjectError(
                f"object {key} has no composer-diloco header (partial or foreign write)."
            )
        env = self.hmac_key_env
        if self._hmac_key is not None and magic != MAGIC_HMAC:
            raise AuthenticationError(
                f"object {key} is not authenticated (written without ${env}); this replica has "
                f"${env} set and refuses unsigned objects: give every replica the same secret."
            )
        if self._hmac_key is None and magic == MAGIC_HMAC:
            raise AuthenticationError(
                f"object {key} is HMAC-signed but ${env} is not set on this replica, which cannot "
                "verify it: give every replica the same secret."
            )

    def _verify(self, data: Payload, key: str) -> tuple[dict[str, Any], memoryview, bytes, list[bool | None]]:
        """Check the header, the tag and every chunk's checksum; return (meta, body, tag, finite): per
        tensor, whether its values are all finite, checked piece by piece as they are hashed (None where
        the layout gives no dtype to check them as: a quantized or malformed one, checked after decoding).

        Any flipped byte is caught: in the tag, lengths, meta or table by the tag (SHA-256 /
        HMAC-SHA256 over them); in the body by its chunk's XXH3-64 (a random corruption passes with
        probability 2^-64) or SHA-256; a truncated body by its length."""
        view = memoryview(data)
        if view.format != "B":
            view = view.cast("B")
        self._check_header(view, key)
        tag = bytes(view[len(MAGIC) : len(MAGIC) + _DIGEST])
        meta_len = int.from_bytes(view[_HEAD - 8 : _HEAD - 4], "little")
        table_len = int.from_bytes(view[_HEAD - 4 : _HEAD], "little")
        end = _HEAD + meta_len + table_len
        if end > len(view) or not hmac.compare_digest(self._tag(view[_HEAD - 8 : end]), tag):
            raise self._damaged(key, len(view), "header")
        try:
            meta = json.loads(bytes(view[_HEAD : _HEAD + meta_len]))
            sizes = [int(e["nbytes"]) for e in meta["layout"]]
            chunk = int(meta["chunk"])
            if chunk < 1 or min(sizes, default=0) < 0:
                raise ValueError(f"chunk={chunk}, nbytes={sizes}")
        except (ValueError, KeyError, TypeError) as exc:  # tag matched: a foreign/garbage writer
            raise CorruptObjectError(f"object {key} does not decode: {exc}") from exc
        body = view[end:]
        if sum(sizes) != len(body):
            raise self._damaged(key, len(view), f"body of {len(body)} bytes, its header lists {sum(sizes)}")
        pieces = _pieces(_split(body, sizes), chunk)
        table = view[_HEAD + meta_len : end]
        width = _Hasher.width(self._signed)
        if len(pieces) * width != table_len:
            raise CorruptObjectError(
                f"object {key} has an invalid tensor layout: {len(pieces)} chunks, {table_len} checksum bytes."
            )
        sums, finite = _scan(self._signed, pieces, _checkable(meta, chunk), None, self.checksum_parallel)
        if sums != table:
            bad = next(
                i
                for i in range(len(pieces))
                if sums[i * width : (i + 1) * width] != table[i * width : (i + 1) * width]
            )
            start = sum(p.nbytes for _, p in pieces[:bad])
            raise self._damaged(key, len(view), f"body bytes {start}-{start + pieces[bad][1].nbytes}")
        return meta, body, tag, finite

    def decode(
        self,
        data: Payload,
        *,
        round_id: int,
        rank: int,
        key: str = "?",
        expect: Mapping[str, Any] | None = None,
    ) -> _Decoded:
        """Validate and deserialise an object; raise :class:`CorruptObjectError` naming ``key``
        (:class:`AuthenticationError` for a missing/wrong HMAC, :class:`NonFiniteObjectError`
        for NaN/inf values)."""
        meta, buf, tag, finite = self._verify(data, key)
        layout = list(meta["layout"])
        if meta.get("exchange", "full") != self.exchange:
            raise CorruptObjectError(
                f"object {key} was written by a replica with exchange={meta.get('exchange', 'full')!r}, "
                f"this one uses exchange={self.exchange!r}: every replica of a run must use the same."
            )
        expected = {**self._meta(round_id, rank), **(expect or {})}
        for name, want in expected.items():
            if meta.get(name) != want:
                raise CorruptObjectError(f"object {key} has {name}={meta.get(name)!r}, expected {want!r}.")
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
                raw = _frombuffer(buf, nbytes, offset, wire)
                t = raw if len(shape) == 1 else raw.view(shape)
                tensors.append(dequantize_fp8(t, float(entry["scale"])) if meta.get("quantized") else t)
                offset += nbytes
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
            raise CorruptObjectError(f"object {key} has an invalid tensor layout: {exc}") from exc
        if offset != len(buf):
            raise CorruptObjectError(
                f"object {key} carries {len(buf) - offset} trailing bytes beyond its layout."
            )
        for i, t in enumerate(tensors):
            if not (finite[i] if finite[i] is not None else _all_finite(t)):
                raise NonFiniteObjectError(
                    f"object {key} passes its checksum but tensor {i} holds NaN/inf; it is never "
                    "averaged (a replica with a diverged inner loop, or a foreign writer)."
                )
        return _Decoded(meta, tensors, len(data), tag)

    # ---- storage primitives -----------------------------------------------------------
    def _local_tmp(self, key: str) -> tuple[str, io.BufferedWriter]:
        """A temporary file to write ``key``'s bytes into before it is linked or swapped in: a spare one
        (:meth:`_make_spares`) when there is one, else a new one, in the run's ``tmp/`` folder (the same
        filesystem as ``key``)."""
        self._tmp_taken += 1
        return self._spare(self._spares) or self._new_tmp()

    def _spare(self, pool: list[_T]) -> _T | None:
        """The last file of ``pool`` (made ahead), or None if it is empty or this is a forked child, which never
        writes its parent's files."""
        return pool.pop() if pool and self._pid == os.getpid() else None

    def _object_tmp(self, key: str, size: int) -> tuple[str, io.BufferedWriter, int]:
        """A temporary file for an object of ``size`` bytes, and how many bytes of zeros it holds already: one
        filled ahead (:meth:`_prefill`) for an object of at least ``_PREFILL_MIN`` bytes when there is one, else
        :meth:`_local_tmp`'s. Notes the size, so that the next round's is filled ahead too."""
        if size < _PREFILL_MIN:
            return (*self._local_tmp(key), 0)
        if sum(self._fill_sizes) + size <= _PREFILL_BYTES:
            self._fill_sizes.append(size)
        return self._spare(self._filled) or (*self._local_tmp(key), 0)

    def _prefill(self, sizes: Sequence[int]) -> None:
        """Temporary files holding ``sizes`` bytes of zeros, for the next round's objects (:meth:`_object_tmp`),
        made by the background worker: its write over them then lands on pages the page cache holds already."""
        zeros = memoryview(bytes(min(max(sizes, default=0), _STREAM_READ)))
        for size in sizes[len(self._filled) :]:
            tmp, f = self._new_tmp(ahead=True)
            try:
                for lo in range(0, size, zeros.nbytes):
                    f.write(zeros[: size - lo])
                f.seek(0)
            except OSError:  # a full disk: no partial file is left behind, the round writes a new one
                with contextlib.suppress(OSError):
                    f.close()
                self._drop_name(tmp, False)
                raise
            self._filled.append((tmp, f, size))

    def _new_tmp(self, ahead: bool = False) -> tuple[str, io.BufferedWriter]:
        """A new temporary file in the run's ``tmp/`` folder, made if missing; ``ahead`` (the background worker):
        only inside the run's folder, never the run's folder itself (a run removed meanwhile is not made again)."""
        tmp = f"{self._tmp_dir}/.tmp-{uuid.uuid4().hex}"
        # small tensors' pieces go down in 64 KiB writes, not one (8 KiB buffer) per tensor: 200 tensors of 1 MiB
        # in all published in 2.5 ms, not 2.9; pieces of 64 KiB or more are written from the tensors' memory
        f = _in_folder(lambda: io.FileIO(tmp, "x"), self._tmp_dir, parents=not ahead)
        return tmp, io.BufferedWriter(f, _WRITE_BUFFER)

    def _make_spares(self, count: int, folder: str, fill: Sequence[int] = ()) -> None:
        """Delete the round's spent temporary names (:meth:`_drop_name`), then make the next round's ``folder``
        and temporary files for its writes (run in the background after a round, like the deletions): creating a
        file or a folder is a journaled metadata operation (~45 / ~30 µs on ext4), and a round writes three files
        (object, manifest, marker) into a folder of its own, half of a 1 MiB round's fixed cost on its critical
        path. The folder is made only after this round is committed: a folder of a later round means the run
        has left a round, whose manifest then exists (:meth:`_await_manifest`); an empty one is no stored
        round (:meth:`rounds_present`). ``fill``: the sizes of this round's objects, for which files holding
        as many zeros are made (:meth:`_prefill`). Only inside the run's folders: a run removed meanwhile
        (:meth:`cleanup_run` by another replica) is not made again, and nothing is made."""
        _unlink_all(self._trash)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder)  # inside the run's rounds/ folder, never making it
            while len(self._spares) < count:
                self._spares.append(self._new_tmp(ahead=True))
            self._prefill(fill)
        except OSError as exc:  # a round then creates its files itself, and reports a real failure
            if os.path.isdir(self.prefix):
                logger.warning("could not create temporary files ahead in %s: %s", self._tmp_dir, exc)

    def _link_into(self, tmp: str, key: str) -> bool:
        """``os.link(tmp, key)`` (create-only: False if ``key`` exists), making ``key``'s folder if missing."""
        try:
            _in_folder(lambda: os.link(tmp, key), posixpath.dirname(key))
            return True
        except FileExistsError:
            return False

    def put_atomic(self, key: str, data: bytes) -> None:
        """Write ``data`` so that readers see all of it or nothing (the old value until then)."""
        if self._local:
            tmp, f = self._local_tmp(key)
            exchanged: bool | None = None
            try:
                with f:
                    f.write(data)
                exchanged = self._swap_in(tmp, key)
            finally:
                if exchanged is None:  # the write failed: no temporary file is left behind
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                elif exchanged:  # tmp names the old file
                    self._drop_name(tmp, True)
        else:  # object stores publish a single PUT atomically
            self.fs.pipe_file(key, data)
        self.bytes_written += len(data)

    def _swap_in(self, tmp: str, key: str) -> bool:
        """Make the complete file ``tmp`` the file at ``key``, atomically for readers (no fsync: visibility, not
        crash durability). An existing ``key`` is exchanged with ``tmp`` (Linux ``renameat2`` with
        ``RENAME_EXCHANGE``; ``tmp`` then names the old file): renaming over an existing file makes ext4 start
        writing the new one back first (``auto_da_alloc``), ~0.1 ms of a marker update's ~0.15 ms. Elsewhere,
        for a new ``key``, or on a filesystem without exchange: ``os.replace``. True if exchanged."""
        if self._exchange and _RENAMEAT2 is not None:
            if _RENAMEAT2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(key), _RENAME_EXCHANGE) == 0:
                return True
            err = ctypes.get_errno()
            if err != errno.ENOENT:  # EINVAL/ENOTSUP: this filesystem cannot exchange; ENOSYS: nor the kernel
                self._exchange = False
        _in_folder(lambda: os.replace(tmp, key), posixpath.dirname(key))
        return False

    def _drop_name(self, tmp: str, later: bool) -> None:
        """Delete the temporary name ``tmp``: ``later`` (a second name of a linked object, a complete file whose
        create lost, or an exchanged-out marker) in the background worker with the next spares, since an unlink
        right after ``os.sync`` or a write-back cost ~65 µs on ext4; at once otherwise (a failed write) or in a
        forked child."""
        if later and self._pid == os.getpid():
            self._trash.append(tmp)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def put_if_absent(self, key: str, data: bytes | _Encoded) -> bool:
        """Create ``key`` only if it does not exist (conditional put); True if we created it.

        Readers see all of ``data`` or nothing: local filesystems link a complete temporary
        file, S3 publishes a single PUT or a completed multipart upload (parts in parallel,
        s3fs's ``max_concurrency``)."""
        enc = data if isinstance(data, _Encoded) else _Encoded(bytes(data), [], b"")
        created = self._create(key, enc)
        if created:
            self.bytes_written += enc.size
        return created

    def _create(self, key: str, enc: _Encoded) -> bool:
        if self._local:
            tmp, f, filled = self._object_tmp(key, enc.size)
            written = False
            try:
                with f:  # straight from the tensors' memory: no joined copy
                    f.write(enc.head)  # unsealed: a placeholder, rewritten once the body is written
                    if enc.unsealed is None:
                        for chunk in enc.chunks:
                            f.write(chunk)
                    else:
                        self._seal(enc, f.write)
                        f.seek(0)
                        f.write(enc.head)
                    if filled > enc.size:  # zeros made ahead for a larger object: not part of this one
                        f.truncate(enc.size)
                written = True
                return self._link_into(tmp, key)  # atomic, fails if key exists
            finally:  # a failed write (a full disk) leaves no temporary file; a linked or losing one goes later
                self._drop_name(tmp, written)
        if enc.unsealed is not None:
            self._seal(enc)
        if _is_s3(self.fs):
            return bool(fsspec.asyn.sync(self.fs.loop, self._s3_create, key, enc))
        data = enc.tobytes()  # one copy: this client wants one bytes-like body
        if self._memory:
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

    async def _s3_create(self, key: str, enc: _Encoded) -> bool:
        """Create-only S3 upload. Below 2 parts of ``s3_part_bytes``: one PUT with
        ``If-None-Match: *``, its body joined up to ``S3_JOINED_PUT_BYTES`` and above that streamed
        from the encoded object's memory (no joined copy). From 2 parts up: a multipart upload
        (:meth:`_s3_multipart`) whose completion carries ``If-None-Match: *``: readers never see
        part of it."""
        fs, size, part = self.fs, enc.size, self.s3_part_bytes
        bucket, name, _ = fs.split_path(key)
        try:
            if size < 2 * part:
                body: bytes | _Stream = (
                    enc.tobytes()
                    if size <= S3_JOINED_PUT_BYTES
                    else _Stream([memoryview(enc.head), *enc.chunks])
                )
                await fs._call_s3("put_object", Bucket=bucket, Key=name, Body=body, IfNoneMatch="*")
            else:
                await self._s3_multipart(bucket, name, enc)
            return True
        except FileExistsError:
            return False
        finally:
            fs.invalidate_cache(key)

    async def _s3_multipart(self, bucket: str, name: str, enc: _Encoded) -> None:
        """Parts of ``s3_part_bytes`` go up in parallel, at most ``s3_parts_in_flight`` at once, each
        body streamed from the tensors' memory (a seekable view: botocore reads it to sign and hash,
        aiohttp to send; never a joined copy of the object nor of a part). Any failure aborts the
        upload, so no part of it is ever visible. ``upload_part`` takes PartNumber before UploadId:
        the query string reads ``?partNumber=N&uploadId=...`` as S3's documentation writes it."""
        fs, size, part = self.fs, enc.size, self.s3_part_bytes
        views = [memoryview(enc.head), *enc.chunks]
        upload = (await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=name))["UploadId"]
        gate = asyncio.Semaphore(self.s3_parts_in_flight)

        async def put_part(number: int, lo: int) -> dict[str, Any]:
            async with gate:
                body = _Stream(views, lo, min(lo + part, size))  # streamed from the tensors' memory
                out = await fs._call_s3(
                    "upload_part", Bucket=bucket, Key=name, PartNumber=number, UploadId=upload, Body=body
                )
            return {"PartNumber": number, "ETag": out["ETag"]}

        tasks = [asyncio.ensure_future(put_part(i + 1, lo)) for i, lo in enumerate(range(0, size, part))]
        try:
            parts = await asyncio.gather(*tasks)
            await fs._call_s3(
                "complete_multipart_upload", Bucket=bucket, Key=name, UploadId=upload,
                MultipartUpload={"Parts": list(parts)}, IfNoneMatch="*",
            )  # fmt: skip
        except BaseException:
            for task in tasks:  # no part starts after a failure; the ones in flight end before the abort
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=name, UploadId=upload)
            raise

    async def _s3_read_into(self, key: str, slot: str) -> memoryview | None:
        """One GET streamed into the slot's buffer (reused across rounds): no full-size bytes
        object, no HEAD. A short or failed stream is retried twice, then returned short (its
        checksum then fails and the object is re-read or reported)."""
        bucket, name, _ = self.fs.split_path(key)
        view, got = memoryview(b""), 0
        for attempt in range(3):
            try:
                resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=name)
            except FileNotFoundError:
                return None
            body = resp["Body"]
            try:
                size = int(resp["ContentLength"])
                view, got = self._slot(slot, size), 0
                while got < size:
                    n = await body.readinto(view[got : got + _STREAM_READ])
                    if not n:
                        break
                    got += n
            except Exception:
                if attempt == 2:
                    raise
                continue
            finally:
                closed = body.close()
                if asyncio.iscoroutine(closed):
                    await closed
            if got == size:
                break
        self.bytes_read += got
        return view[:got]

    def _slot(self, slot: str, size: int) -> memoryview:
        """A writable ``size``-byte view of the read buffer kept for ``slot`` across rounds."""
        buf = self._buffers.get(slot)
        if buf is None or len(buf) < size:
            buf = self._buffers[slot] = bytearray(size)
        return memoryview(buf)[:size]

    def _read(self, key: str, slot: str | None = None) -> Payload | None:
        """The object's bytes, or None if absent. With ``slot`` on a local filesystem the object is mapped or
        read into a buffer kept for that slot across rounds (:meth:`_read_local`)."""
        if self._local:
            if slot is not None:
                return self._read_local(key, slot)
            try:  # a manifest or a marker: one open and read (fsspec's cat_file costs ~10x that)
                with open(key, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                return None
            self.bytes_read += len(data)
            return data
        if slot is not None and _is_s3(self.fs):
            return fsspec.asyn.sync(self.fs.loop, self._s3_read_into, key, slot)  # type: ignore[no-any-return]
        self.fs.invalidate_cache(posixpath.dirname(key))  # s3fs answers from a stale listing otherwise
        try:
            data = self.fs.cat_file(key, **self._cat_options)
        except FileNotFoundError:
            return None
        self.bytes_read += len(data)
        return bytes(data)

    def _read_many(self, keys: Sequence[str], slots: Sequence[str]) -> list[Payload | None]:
        """:meth:`_read` of each key into its slot; on S3 the GETs are in flight together."""
        if len(keys) < 2 or not _is_s3(self.fs):
            return [self._read(key, slot=slot) for key, slot in zip(keys, slots)]

        async def gather() -> list[Any]:  # every GET ends before any error is raised: no stray writer
            return await asyncio.gather(
                *(self._s3_read_into(key, slot) for key, slot in zip(keys, slots)), return_exceptions=True
            )

        got = fsspec.asyn.sync(self.fs.loop, gather)
        for item in got:
            if isinstance(item, BaseException):
                raise item
        return list(got)

    def _read_local(self, key: str, slot: str) -> memoryview | None:
        """A local object's bytes. Of ``_MAP_MIN`` bytes or more, unsigned: its page-cache pages mapped
        copy-on-write, so checksums and the sum read them in place, with no copy into a buffer (a third of a
        round's memory traffic at 64 MiB). Objects are create-only (linked complete, never rewritten; deletion
        keeps a mapping valid), so the mapped bytes are the checked bytes. Otherwise read into the slot's buffer
        (:meth:`_slot`): below ``_MAP_MIN`` a copy that stays in cache costs less than the mapping's page faults
        and unmapping; a signed object is always copied, since an untrusted writer could change a mapped file
        between its check and its use."""
        try:
            f = open(key, "rb", buffering=0)  # noqa: SIM115  # closed below, also when mapped
        except FileNotFoundError:
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size >= _MAP_MIN and self._hmac_key is None:
                self.bytes_read += size
                return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
            view, got = self._slot(slot, size), 0
            while got < size:  # a file shorter than its size a moment ago reads short: its tag fails
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        self.bytes_read += got
        return view[:got]

    def _list(self, directory: str) -> set[str]:
        if self._local:
            try:
                return set(os.listdir(directory))
            except (FileNotFoundError, NotADirectoryError):
                return set()
        self.fs.invalidate_cache(directory)
        try:
            entries = self.fs.ls(directory, detail=False)
        except FileNotFoundError:
            return set()
        return {posixpath.basename(str(e).rstrip("/")) for e in entries}

    # ---- signed JSON (manifests, markers) ---------------------------------------------
    def _dump_json(self, obj: dict[str, Any]) -> bytes:
        if self._hmac_key is not None:
            obj = {**obj, "hmac": hmac.new(self._hmac_key, _canonical(obj), hashlib.sha256).hexdigest()}
        return json.dumps(obj, sort_keys=True).encode()

    def _load_json(self, raw: bytes, key: str) -> dict[str, Any]:
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict):
                raise TypeError(f"a JSON {type(obj).__name__}, not an object")
        except (ValueError, TypeError) as exc:
            raise CorruptObjectError(f"{key} is not valid JSON of this run: {exc}") from exc
        mac = obj.pop("hmac", None)
        env = self.hmac_key_env
        if self._hmac_key is None:
            if mac is not None:
                raise AuthenticationError(
                    f"{key} is HMAC-signed but ${env} is not set on this replica: give every replica the same secret."
                )
            return obj
        want = hmac.new(self._hmac_key, _canonical(obj), hashlib.sha256).hexdigest()
        if not isinstance(mac, str) or not hmac.compare_digest(mac, want):
            raise AuthenticationError(
                f"{key} is {'unsigned' if mac is None else 'wrongly signed'}: this replica has ${env} set "
                "and refuses it (written without the secret, with a different one, or altered)."
            )
        return obj

    # ---- manifests and progress markers -------------------------------------------------
    def _read_manifest(self, round_id: int) -> _Manifest | None:
        key = self.manifest_key(round_id)
        raw = self._read(key)
        return None if raw is None else self._parse_manifest(bytes(raw), key, round_id)

    def _parse_manifest(self, raw: bytes, key: str, round_id: int) -> _Manifest:
        m = self._load_json(raw, key)
        try:
            ranks = m["ranks"]
            tags = {int(r): bytes.fromhex(t) for r, t in m["tags"].items()}
            ok = (
                m["run_id"] == self.run_id
                and m["round"] == round_id
                and m["world_size"] == self.world_size
                and isinstance(ranks, list)
                and all(
                    isinstance(r, int) and not isinstance(r, bool) and 0 <= r < self.world_size for r in ranks
                )
                and ranks == sorted(set(ranks))
                and len(ranks) > 0
                and sorted(tags) == ranks
                and all(len(t) == _DIGEST for t in tags.values())
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptObjectError(f"manifest {key} is not a manifest of this run: {exc}") from exc
        if not ok:
            raise CorruptObjectError(
                f"manifest {key} does not describe round {round_id} of run {self.run_id!r} with "
                f"world_size={self.world_size} (ranks {m.get('ranks')!r})."
            )
        return _Manifest(list(ranks), tags, hashlib.sha256(raw).hexdigest())

    def _propose_manifest(self, round_id: int, decoded: Mapping[int, _Decoded]) -> bytes | None:
        """Create the round's manifest; its bytes if this replica's proposal won, else None."""
        proposal = {
            "run_id": self.run_id,
            "round": round_id,
            "world_size": self.world_size,
            "ranks": sorted(decoded),
            "tags": {str(r): d.tag.hex() for r, d in sorted(decoded.items())},
            "proposer": self.rank,
        }
        data = self._dump_json(proposal)
        return data if self.put_if_absent(self.manifest_key(round_id), data) else None

    def _read_marker(self, rank: int) -> dict[int, str] | None:
        """Replica ``rank``'s progress marker: ``{round: manifest fingerprint}`` (None if absent)."""
        key = self.marker_key(rank)
        raw = self._read(key)
        if raw is None:
            return None
        obj = self._load_json(bytes(raw), key)
        try:
            if obj["run_id"] != self.run_id or obj["rank"] != rank:
                raise ValueError(f"run_id/rank {obj['run_id']!r}/{obj['rank']!r}")
            return {int(k): str(v) for k, v in obj["accepted"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptObjectError(f"progress marker {key} is not a marker of this run: {exc}") from exc

    def _read_markers(self, skip: int | None = None) -> dict[int, dict[int, str]]:
        own = self._marker  # this replica's marker is only written by itself: no GET once known
        markers = {
            r: dict(own) if r == self.rank and own is not None else self._read_marker(r)
            for r in range(self.world_size)
            if r != skip
        }
        return {r: m for r, m in markers.items() if m is not None}

    def _commit_evidence(self, round_id: int) -> str | None:
        """Why round ``round_id`` must already be committed (None if nothing says so)."""
        later = [r for r in self._rounds_stored() if r > round_id]
        if later:
            return f"the store already holds round {max(later)}"
        for rank, accepted in sorted(self._read_markers().items()):
            if round_id in accepted:
                return f"rank {rank} accepted its manifest"
            if accepted and max(accepted) > round_id:
                return f"rank {rank} has reached round {max(accepted)}"
        return None

    def _expired(self, round_id: int, evidence: str, what: str) -> RoundExpiredError:
        return RoundExpiredError(
            f"round {round_id} of run {self.run_id!r} was already committed ({evidence}) but {what}: "
            "this replica cannot get the committed average and will not recompute it. It fell more "
            f"than keep_rounds={self.keep_rounds} rounds behind (or the round was deleted from the "
            "store): restart it from a checkpoint of the run's current round (or heal it from a "
            "healthy replica). If this is a new run, use a new run_id."
        )

    def _committed(self, round_id: int) -> _Manifest | None:
        """The committed manifest of ``round_id``; None if the round is still open;
        :class:`RoundExpiredError` if it was committed and its manifest is gone."""
        manifest = self._read_manifest(round_id)
        if manifest is not None:
            return manifest
        evidence = self._commit_evidence(round_id)
        if evidence is None:
            return None
        manifest = self._read_manifest(round_id)  # committed since the first read?
        if manifest is None:
            raise self._expired(round_id, evidence, "its manifest is gone")
        return manifest

    def _accept(self, round_id: int, manifest: _Manifest) -> None:
        """Record that this replica applies ``manifest`` for ``round_id``, then check that no
        replica accepted another one. Marker first, reads second: of two replicas accepting
        different manifests, the later reader sees the other's marker and raises. If the round
        turns out to be one the run has left, the record is taken back (nothing is applied)."""
        before = dict(self._marker if self._marker is not None else self._read_marker(self.rank) or {})
        self._record({**before, round_id: manifest.fingerprint})
        try:
            self._check_markers(round_id, manifest)
        except RoundExpiredError:
            self._record(before)
            raise

    def _record(self, accepted: Mapping[int, str]) -> None:
        """Write this replica's progress marker: the newest ``keep_rounds + 1`` accepted rounds."""
        newest = {r: accepted[r] for r in sorted(accepted)[-(self.keep_rounds + 1) :]}
        marker = {
            "run_id": self.run_id,
            "rank": self.rank,
            "accepted": {str(r): v for r, v in newest.items()},
        }
        self.put_atomic(self.marker_key(self.rank), self._dump_json(marker))
        self._marker = newest

    def _check_markers(self, round_id: int, manifest: _Manifest) -> None:
        for rank, accepted in sorted(self._read_markers(skip=self.rank).items()):
            theirs = accepted.get(round_id)
            if theirs is not None and theirs != manifest.fingerprint:
                # it went on under the first manifest: ours was proposed after that one was gone
                if max(accepted) > round_id:
                    raise self._expired(
                        round_id,
                        f"rank {rank} applied another manifest for it and has reached round {max(accepted)}",
                        "its manifest is gone (this replica's proposal came after it)",
                    )
                raise RoundConflictError(
                    f"round {round_id}: rank {rank} applied a different manifest than this replica "
                    f"(rank {self.rank}); the manifest was deleted and proposed again while replicas "
                    "were reading it. Replicas no longer hold the same weights: stop the run and restart "
                    "every replica from one checkpoint."
                )
            if theirs is None and accepted and min(accepted) > round_id:
                raise self._expired(
                    round_id,
                    f"rank {rank} has reached round {max(accepted)}",
                    "this replica cannot check which manifest the others applied",
                )

    # ---- the round --------------------------------------------------------------------
    def allreduce(
        self,
        round_id: int,
        tensors: Sequence[torch.Tensor],
        *,
        quantize: bool = False,
        op: Literal["avg", "sum"] = "avg",
    ) -> RoundStats:
        """Replace ``tensors`` in place with their average (or sum) over the round's participants.

        If round ``round_id`` is already committed, the committed average is adopted (this
        replica's new values are not used) and ``stats.adopted`` is True; if its committed
        result is gone, :class:`RoundExpiredError` is raised and ``tensors`` are unchanged.
        """
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}.")
        laps = _Laps()
        written0, read0 = self.bytes_written, self.bytes_read
        self._tmp_taken, self._fill_sizes = 0, []
        # In step (this instance completed round r - 1), nothing of round r is this replica's yet: the
        # committed-round check rides on the wait and the markers (module docstring, step 1).
        in_step, self._next_round, self._proposed = self._next_round == round_id, None, None
        problems: dict[int, CorruptObjectError] = {}
        manifest = None if in_step else self._committed(round_id)
        laps("commit")
        own: _Decoded | None = None
        reused = False  # this replica's object of the round was there before this call
        adopted = manifest is not None
        try:
            if manifest is None:
                own, reused = self._contribute(round_id, tensors, quantize)
                laps("publish")
                decoded = {self.rank: own}
                manifest = self._await_manifest(round_id, decoded, problems)
                laps("commit")
                adopted = reused or manifest.tags.get(self.rank) != own.tag  # or committed without it
            else:
                decoded = {}
                logger.warning(
                    "round %d is already committed (ranks %s): rank %d adopts its average, not its new values",
                    round_id,
                    manifest.ranks,
                    self.rank,
                )
            self._apply_round(round_id, manifest, decoded, tensors, None if adopted else own, op, laps)
        except RoundExpiredError:
            if own is not None and not reused:  # this call's objects belong to a round the run has left
                self._discard(round_id)
            raise
        self._cleanup(round_id, manifest)
        self._spare_ahead(round_id + 1)
        self._next_round = round_id + 1
        participants = manifest.ranks
        self.last = RoundStats(
            round=round_id,
            participants=list(participants),
            excluded={
                r: str(problems.get(r, "no object")) for r in range(self.world_size) if r not in participants
            },
            bytes_written=self.bytes_written - written0,
            bytes_read=self.bytes_read - read0,
            seconds=time.perf_counter() - laps.start,
            adopted=adopted,
            phases=laps.phases,
        )
        if self.last.excluded:
            logger.warning("round %d proceeded without ranks %s", round_id, self.last.excluded)
        return self.last

    def _apply_round(
        self,
        round_id: int,
        manifest: _Manifest,
        decoded: dict[int, _Decoded],
        tensors: Sequence[torch.Tensor],
        local: _Decoded | None,
        op: str,
        laps: _Laps,
    ) -> None:
        """Read the committed objects, record acceptance (:meth:`_accept`), then write the result
        into ``tensors``: nothing changes before every check has passed. ``laps`` times the phases."""
        inputs = self._gather(round_id, manifest, decoded)
        participants = manifest.ranks
        self.colocated = max(1, sum(d.meta.get("machine") == self._machine for d in inputs.values()))
        _check_layouts(inputs, participants, round_id)
        _check_targets(inputs[participants[0]], tensors, round_id)
        with torch.no_grad():
            if self.exchange == "sharded":
                sums = self._sharded_result(round_id, manifest, inputs, local, op)
                laps("reduce")
                self._accept(round_id, manifest)
                laps("accept")
                for t, acc in zip(tensors, sums):
                    _apply(t, acc, 1)
            else:
                xs = [inputs[r].tensors for r in participants]
                staged = self._stage(round_id, tensors, xs, op)  # every check before anything changes
                laps("reduce")
                self._accept(round_id, manifest)
                laps("accept")
                self._reduce_into(tensors, xs, op, staged)
        laps("apply")

    def _contribute(
        self, round_id: int, tensors: Sequence[torch.Tensor], quantize: bool
    ) -> tuple[_Decoded, bool]:
        """Publish this replica's object (full) or shards + index (sharded); True if an object
        published earlier (a re-run of the round) is the contribution instead."""
        if self.exchange == "sharded":
            index, own = self._encode_sharded(round_id, tensors, quantize)
            mine, reused = self._publish(round_id, index, own)
            return mine, reused
        data, own = self._encode(round_id, tensors, quantize, stream=self._local)
        return self._publish(round_id, data, own)

    def _stage(
        self,
        round_id: int,
        tensors: Sequence[torch.Tensor],
        inputs: Sequence[Sequence[torch.Tensor]],
        op: str,
    ) -> dict[int, torch.Tensor]:
        """The results of the targets that are not written piece by piece (:func:`_direct_targets`; under
        ``op="sum"``, whose result may be beyond float32, every target), by index, computed into the accumulators
        and checked: raises :class:`NonFiniteResultError` before any tensor changes."""
        direct = set() if op == "sum" else _direct_targets(tensors)
        rest = [i for i in range(len(tensors)) if i not in direct]
        if not rest:
            return {}
        sums, finite = self._reduce([[x[i] for i in rest] for x in inputs], op)
        if not all(finite):
            raise NonFiniteResultError(_overflow_message(round_id, f"tensor {rest[finite.index(False)]}", op))
        return dict(zip(rest, sums))

    def _reduce_into(
        self,
        tensors: Sequence[torch.Tensor],
        inputs: Sequence[Sequence[torch.Tensor]],
        op: str,
        staged: Mapping[int, torch.Tensor],
    ) -> None:
        """``tensors ← Σ_r inputs[r]`` (float32, rank order), ``/ n`` for avg. The ``staged`` results
        (:meth:`_stage`) are copied in first (they may read memory a direct target shares); every other target, a
        contiguous CPU tensor sharing memory with no other, is written piece by piece through a cache-sized
        float32 scratch (:func:`_reduce_pieces`: no payload-sized accumulator, one pass less), small float32 ones
        several at a time (:func:`_reduce_bucket`). The same bits either way."""
        for i, acc in staged.items():
            _apply(tensors[i], acc, 1)
        divisor = len(inputs) if op == "avg" else 1
        if self._scratch is None:  # a fresh one per round cost its page faults every round
            self._scratch = torch.empty(_REDUCE_PIECE, dtype=torch.float32)
        rest = [i for i in range(len(tensors)) if i not in staged]
        small = [i for i in rest if _bucketable(tensors[i], [x[i] for x in inputs])]
        for bucket in _runs(small, [tensors[i].numel() for i in small], _REDUCE_PIECE):
            columns = [[x[i] for i in bucket] for x in inputs]
            _reduce_bucket([tensors[i] for i in bucket], columns, divisor, self._scratch)
        for i in sorted(set(rest) - set(small)):
            _reduce_pieces(tensors[i], [x[i] for x in inputs], divisor, self._scratch)

    def _reduce(
        self, inputs: Sequence[Sequence[torch.Tensor]], op: str
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """``Σ x_r`` in float32 in the given (rank) order, then ``/ n`` for ``avg`` (:func:`_sum_into`): the
        order torchft's gloo path uses, and whether each result is finite. Accumulators are reused across
        rounds."""
        shapes = [t.numel() for t in inputs[0]]
        if [a.numel() for a in self._acc] != shapes:
            self._acc = [torch.empty(n, dtype=torch.float32) for n in shapes]
        return self._acc, _sum_into(self._acc, inputs, op)

    def _publish(self, round_id: int, data: _Encoded, own: _Decoded) -> tuple[_Decoded, bool]:
        """Create this replica's object; if it exists already (a re-run of the round), return the
        stored one: objects are immutable, other replicas may have read it. True if reused."""
        key = self.object_key(round_id, self.rank)
        created = self.put_if_absent(key, data)
        own.tag = data.tag  # an object streamed to a local file is sealed by its write
        if created:
            return own, False
        raw = self._read(key, slot=f"obj-{self.rank}")
        if raw is None:
            raise ObjectStoreError(f"round {round_id}: {key} exists but could not be read; retry the round.")
        stored = self.decode(raw, round_id=round_id, rank=self.rank, key=key)
        if stored.tag != own.tag:
            logger.warning(
                "round %d: rank %d's object %s was published earlier with other values; it is "
                "immutable (other replicas may have read it), so this round uses the stored one",
                round_id,
                self.rank,
                key,
            )
        return stored, True

    def _gather(
        self, round_id: int, manifest: _Manifest, decoded: dict[int, _Decoded]
    ) -> dict[int, _Decoded]:
        """The committed objects: each participant's object with the tag the manifest lists."""
        out: dict[int, _Decoded] = {}
        for r in manifest.ranks:
            have = decoded.get(r)
            if have is None or have.tag != manifest.tags[r]:
                key = self.object_key(round_id, r)
                raw = self._read(key, slot=f"obj-{r}")
                if raw is None:
                    raise self._expired(round_id, f"its manifest lists rank {r}", f"{key} is gone")
                have = self.decode(raw, round_id=round_id, rank=r, key=key)
                if have.tag != manifest.tags[r]:
                    raise CorruptObjectError(
                        f"object {key} is not the one committed in round {round_id}'s manifest (its tag "
                        "differs): it was replaced after the round was committed. Objects are create-only; "
                        "something else writes to this run's prefix."
                    )
            out[r] = have
        return out

    # ---- the sharded exchange (reduce-scatter + all-gather through the store) --------------
    def shard_key(self, round_id: int, rank: int, shard: int, nonce: str) -> str:
        return self.key(
            "rounds",
            f"{_check_round(round_id):010d}",
            f"shard-{shard:05d}-rank-{rank:05d}-{safe_part('nonce', nonce)}.bin",
        )

    def reduced_key(self, round_id: int, shard: int) -> str:
        return self.key("rounds", f"{_check_round(round_id):010d}", f"reduced-{shard:05d}.bin")

    def _encode_sharded(
        self, round_id: int, tensors: Sequence[torch.Tensor], quantize: bool
    ) -> tuple[_Encoded, _Decoded]:
        """Write this replica's k shard objects (shard s = the s-th 1/k of every tensor, under a
        fresh nonce, so they never collide), then return the *index* object listing their tags:
        creating the index is what publishes the contribution."""
        forms = [_wire_form(t, i, self.rank, round_id, quantize) for i, t in enumerate(tensors)]
        k, nonce = self.world_size, uuid.uuid4().hex[:16]
        shards: dict[str, _Encoded] = {}
        for s in range(k):
            layout = [{**entry, "shape": [_piece(wire, s, k).numel()]} for _, wire, entry, _ in forms]
            meta = self._meta(
                round_id,
                self.rank,
                exchange="sharded",
                kind="shard",
                shard=s,
                quantized=quantize,
                layout=layout,
            )
            shards[self.shard_key(round_id, self.rank, s, nonce)] = self._pack(
                meta, [_piece(wire, s, k) for _, wire, _, _ in forms], stream=self._local
            )
        self._put_many(shards)  # seals the shards streamed to local files: their tags are known from here
        meta = self._meta(
            round_id,
            self.rank,
            exchange="sharded",
            kind="index",
            quantized=quantize,
            layout=[],
            tensors=[entry for _, _, entry, _ in forms],
            shards=k,
            nonce=nonce,
            shard_tags=[enc.tag.hex() for enc in shards.values()],
            machine=self._machine,
        )
        index = self._pack(meta, [])
        return index, _Decoded(meta, [own for *_, own in forms], index.size, index.tag)

    def _put_many(self, objects: Mapping[str, _Encoded]) -> None:
        """Write objects under fresh keys: one after the other on local/memory stores, all at
        once on object stores (s3fs sends them concurrently)."""
        if self._local or self._memory:
            for key, enc in objects.items():
                if not self.put_if_absent(key, enc):
                    raise ObjectStoreError(
                        f"{key} already exists: a fresh shard key collided; retry the round."
                    )
            return
        self.fs.pipe({key: enc.tobytes() for key, enc in objects.items()})
        self.bytes_written += sum(enc.size for enc in objects.values())

    def _sharded_result(
        self,
        round_id: int,
        manifest: _Manifest,
        indexes: Mapping[int, _Decoded],
        local: _Decoded | None,
        op: str,
    ) -> list[torch.Tensor]:
        """Reduce this replica's shards (participant j of n owns shards s with s % n == j), then
        collect every other reduced shard; a shard whose reducer is silent for ``timeout_s`` is
        reduced by the waiting replica itself. The *stored* reduced shard (create-only, first
        writer wins) is what every replica applies, so all replicas end identical."""
        ranks = manifest.ranks
        k = _shard_count(indexes, ranks, self.world_size, round_id)
        sizes = [math.prod(e["shape"]) for e in indexes[ranks[0]].meta["tensors"]]
        if [a.numel() for a in self._acc] != sizes:
            self._acc = [torch.empty(n, dtype=torch.float32) for n in sizes]
        mine = [s for s in range(k) if ranks[s % len(ranks)] == self.rank]
        deadline = time.monotonic() + self.timeout_s
        try:
            for s in mine + [s for s in range(k) if s not in mine]:
                if s in mine:
                    reduced = self._reduce_shard(round_id, manifest, indexes, s, local, op)
                else:
                    reduced = self._await_reduced(round_id, manifest, indexes, s, local, op, deadline)
                self._place(round_id, s, k, reduced)
        finally:
            self._unwatch()
        return self._acc

    def _place(self, round_id: int, s: int, k: int, reduced: Sequence[torch.Tensor]) -> None:
        """Copy reduced shard ``s`` of ``k`` into the accumulators (unless it was reduced there)."""
        for acc, piece in zip(self._acc, reduced):
            target = _piece(acc, s, k)
            if piece.data_ptr() == target.data_ptr():
                continue  # reduced in place by this replica
            if piece.numel() != target.numel():
                raise CorruptObjectError(
                    f"round {round_id}: reduced shard {s} holds {piece.numel()} values where "
                    f"{target.numel()} belong: it does not match the committed layout."
                )
            target.copy_(piece)

    def _reduce_shard(
        self,
        round_id: int,
        manifest: _Manifest,
        indexes: Mapping[int, _Decoded],
        s: int,
        local: _Decoded | None,
        op: str,
    ) -> list[torch.Tensor]:
        """Σ over the participants (rank order) of their shard ``s``, ``/ n`` for avg; create it
        as ``reduced-<s>.bin`` and return the stored one (another replica may have been first)."""
        k = self.world_size
        inputs = []
        for r in manifest.ranks:
            if r == self.rank and local is not None:
                inputs.append([_piece(t, s, k) for t in local.tensors])
            else:
                inputs.append(self._read_shard(round_id, indexes[r], r, s).tensors)
        sums = [_piece(acc, s, k) for acc in self._acc]  # reduced straight into the accumulators
        finite = _sum_into(sums, inputs, op)
        layout = [{"shape": [t.numel()], "dtype": "float32", "wire": "float32", "scale": None} for t in sums]
        meta = self._meta(
            round_id,
            -1,
            exchange="sharded",
            kind="reduced",
            shard=s,
            manifest=manifest.fingerprint,
            op=op,
            quantized=False,
            layout=layout,
        )
        # published as it is: a sum beyond float32 (op="sum") is refused by every replica, its readers promptly
        reduced = self._pack(meta, sums, check=False, stream=self._local)
        if self.put_if_absent(self.reduced_key(round_id, s), reduced):
            if not all(finite):
                raise NonFiniteResultError(_overflow_message(round_id, f"reduced shard {s}", op))
            return sums
        stored = self._load_reduced(round_id, manifest, s, op)
        if stored is None:
            raise ObjectStoreError(
                f"round {round_id}: reduced shard {s} exists but could not be read; retry."
            )
        return stored

    def _read_shard(self, round_id: int, index: _Decoded, rank: int, s: int) -> _Decoded:
        key = self.shard_key(round_id, rank, s, str(index.meta["nonce"]))
        raw = self._read(key, slot=f"shard-{rank}")
        if raw is None:
            raise self._expired(round_id, f"its manifest lists rank {rank}", f"{key} is gone")
        shard = self.decode(raw, round_id=round_id, rank=rank, key=key, expect={"kind": "shard", "shard": s})
        if shard.tag.hex() != index.meta["shard_tags"][s]:
            raise CorruptObjectError(
                f"object {key} is not the shard rank {rank}'s committed index lists (its tag differs): "
                "it was replaced after publication. The round cannot be reduced; restart the round."
            )
        return shard

    def _load_reduced(self, round_id: int, manifest: _Manifest, s: int, op: str) -> list[torch.Tensor] | None:
        key = self.reduced_key(round_id, s)
        raw = self._read(key, slot="reduced")
        if raw is None:
            return None
        expect = {"kind": "reduced", "shard": s, "manifest": manifest.fingerprint, "op": op}
        try:
            return self.decode(raw, round_id=round_id, rank=-1, key=key, expect=expect).tensors
        except NonFiniteObjectError as exc:  # its inputs were checked finite: their sum is beyond float32
            raise NonFiniteResultError(
                f"{_overflow_message(round_id, f'reduced shard {s}', op)} ({key})"
            ) from exc

    def _await_reduced(
        self,
        round_id: int,
        manifest: _Manifest,
        indexes: Mapping[int, _Decoded],
        s: int,
        local: _Decoded | None,
        op: str,
        deadline: float,
    ) -> list[torch.Tensor]:
        delay = self._first_poll_s
        while True:
            found = self._load_reduced(round_id, manifest, s, op)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                owner = manifest.ranks[s % len(manifest.ranks)]
                logger.warning(
                    "round %d: rank %d wrote no reduced shard %d within timeout_s=%s; rank %d reduces it",
                    round_id,
                    owner,
                    s,
                    self.timeout_s,
                    self.rank,
                )
                return self._reduce_shard(round_id, manifest, indexes, s, local, op)
            self._pause(
                self.round_dir(round_id),
                min(delay, self.poll_interval_s, max(0.0, deadline - time.monotonic())),
                delay,
            )
            delay *= 2

    def _await_manifest(
        self, round_id: int, decoded: dict[int, _Decoded], problems: dict[int, CorruptObjectError]
    ) -> _Manifest:
        """Collect the other ranks' objects until all are present or ``timeout_s`` passes, then
        propose the participant set. The first look reads the missing objects directly (on S3 all at
        once, no listing: replicas in step find them there). Each later look lists first: it finds a
        manifest committed meanwhile (the round went on without this replica: adopt it) and notices
        a run that has left this round (a later round exists: the committed manifest, or
        :class:`RoundExpiredError` when it is gone). On a local filesystem a long wait ends when a file is
        linked into the round's folder (:meth:`_pause`)."""
        try:
            return self._collect(round_id, decoded, problems)
        finally:
            self._unwatch()

    def _collect(
        self,
        round_id: int,
        decoded: dict[int, _Decoded],
        problems: dict[int, CorruptObjectError],
    ) -> _Manifest:
        """:meth:`_await_manifest`'s looks, :meth:`_pause` between them."""
        deadline = time.monotonic() + self.timeout_s
        delay = self._first_poll_s
        names: set[str] | None = None  # None: the first look, which lists nothing
        while True:
            self._take(
                round_id,
                [
                    r
                    for r in range(self.world_size)
                    if r not in decoded and (names is None or f"rank-{r:05d}.bin" in names)
                ],
                decoded,
                problems,
            )
            timed_out = time.monotonic() >= deadline
            if len(decoded) == self.world_size or timed_out:
                if len(decoded) < self.world_size:  # never exclude ranks from a round the run has left
                    committed = self._committed(round_id)
                    if committed is not None:
                        return committed
                    self._check_timeout(round_id, decoded, problems)
                # With every object present the proposal is the only possible one: a manifest committed
                # since the listing makes ours lose (create-only) and is read back; a round the run has
                # left was refused by the check before this replica contributed (or is refused now,
                # at the read-back), and a deletion racing this round is caught by _accept's markers
                # before any tensor changes.
                if len(decoded) == self.world_size and self.rank != min(decoded) and not self._local:
                    found = self._await_proposal(round_id)
                    if found is not None:
                        return found
                return self._propose(round_id, decoded)
            self._pause(
                self.round_dir(round_id),
                min(delay, self.poll_interval_s, max(0.0, deadline - time.monotonic())),
                delay,
            )
            delay *= 2
            names, later = self._scan(round_id)
            if "manifest.json" in names:
                found = self._read_manifest(round_id)
                if found is not None:
                    return found
            if later:
                committed = self._committed(round_id)
                if committed is not None:
                    return committed

    def _pause(self, folder: str, seconds: float, delay: float) -> None:
        """Wait ``seconds`` before the next look for other replicas' files in ``folder``, the poll's ``delay``.
        From ``_WATCH_FROM_S`` on (the third wait), on a local filesystem, the wait ends when a file is made in
        ``folder`` (:class:`_FolderWatch`): a replica waiting for a late one wakes ~25 µs after its link, not up
        to a doubled delay later (~1.3 ms for one 5 ms late). The first waits sleep: a replica a few µs behind is
        found as soon by the next look, and a watched link wakes the waiter through an interrupt that the linking
        replica pays (a 1 MiB round 3-5% longer, 2 replicas in step, when every wait was watched)."""
        watch = self._watching(folder) if delay >= _WATCH_FROM_S else None
        if watch is None:
            time.sleep(seconds)
        else:
            watch.wait(seconds)

    def _watching(self, folder: str) -> _FolderWatch | None:
        """This process's :class:`_FolderWatch`, watching local ``folder``; None where a wait sleeps (not a local
        store, no inotify, or the folder cannot be watched)."""
        if not self._local or _INOTIFY is None:
            return None
        if self._watch is None or self._watch_pid != os.getpid():  # a forked child makes its own
            try:
                self._watch = _FolderWatch()
            except OSError:
                return None
            self._watch_pid = os.getpid()
            weakref.finalize(self, self._watch.close)
        return self._watch if self._watch.watch(folder) else None

    def _unwatch(self) -> None:
        """End the watch of this wait's folder, if :meth:`_pause` made one."""
        if self._watch is not None and self._watch_pid == os.getpid():
            self._watch.unwatch()

    def _await_proposal(self, round_id: int) -> _Manifest | None:
        """With every object present on an object store, rank ``min(ranks)`` proposes and the others read its
        manifest (a losing create-only PUT costs more than a GET), for ``_PROPOSAL_LOOKS`` looks; then they
        propose too (create-only: a proposer that died changes nothing). Not on a local filesystem, where a
        losing create is a failed link and one read (~20 µs) and a poll's sleep ~0.1 ms (the timer slack)."""
        delay = self._first_poll_s
        for look in range(_PROPOSAL_LOOKS):
            found = self._read_manifest(round_id)
            if found is not None or look == _PROPOSAL_LOOKS - 1:
                return found
            time.sleep(delay)
            delay *= 2
        return None

    def _propose(self, round_id: int, decoded: Mapping[int, _Decoded]) -> _Manifest:
        """Create the manifest of ``decoded``'s ranks; the stored one if another proposal won."""
        created = self._propose_manifest(round_id, decoded)
        key = self.manifest_key(round_id)
        if created is not None:  # ours won: no need to read it back
            self._proposed = round_id
            return self._parse_manifest(created, key, round_id)
        found = self._read_manifest(round_id)
        if found is None:
            raise ObjectStoreError(f"round {round_id}: manifest {key} vanished right after creation.")
        return found

    def _take(
        self,
        round_id: int,
        ranks: Sequence[int],
        decoded: dict[int, _Decoded],
        problems: dict[int, CorruptObjectError],
    ) -> None:
        """Read and validate the objects of ``ranks`` that exist now (on S3 concurrently)."""
        keys = [self.object_key(round_id, r) for r in ranks]
        for r, key, raw in zip(ranks, keys, self._read_many(keys, [f"obj-{r}" for r in ranks])):
            if raw is None:
                continue
            try:
                decoded[r] = self.decode(raw, round_id=round_id, rank=r, key=key)
                problems.pop(r, None)
            except CorruptObjectError as exc:
                problems[r] = exc  # maybe still being written by a non-atomic writer: re-read

    def _scan(self, round_id: int) -> tuple[set[str], bool]:
        """The names in round ``round_id``'s folder, and whether a later round is stored: one
        listing of the run's rounds on S3, two directory reads on a local filesystem."""
        if _is_s3(self.fs):
            keys = self._s3_round_keys()
            here = f"{round_id:010d}"
            names = {name for r, name in keys if r == here}
            return names, any(int(r) > round_id for r, _ in keys if r.isdigit())
        return self._list(self.round_dir(round_id)), any(r > round_id for r in self._rounds_listed())

    def _discard(self, round_id: int) -> None:
        """Delete what this call wrote into ``round_id``, a round the run has left: this replica's
        objects and the manifest it proposed, if it did (nobody applies it: every replica that
        accepts it finds the marker of one that went on under the first), and on a local
        filesystem the round's folder if that leaves it empty. Best effort: a failure leaves
        garbage, logged."""
        directory = self.round_dir(round_id)
        mine = f"rank-{self.rank:05d}"
        try:
            for name in self._list(directory):
                if (
                    name == f"{mine}.bin"
                    or (name.startswith("shard-") and f"-{mine}-" in name)
                    or (name == "manifest.json" and self._proposed == round_id)
                ):
                    self.fs.rm_file(f"{directory}/{name}")
            if self._local:
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
        except Exception as exc:
            logger.warning(
                "could not take back rank %d's objects of expired round %d: %s", self.rank, round_id, exc
            )

    def _check_timeout(
        self, round_id: int, decoded: Mapping[int, _Decoded], problems: Mapping[int, CorruptObjectError]
    ) -> None:
        """Raise per ``on_timeout`` / ``min_replicas`` when ranks are missing at the deadline."""
        missing = {r: str(problems.get(r, "no object")) for r in range(self.world_size) if r not in decoded}
        corrupt = {r: problems[r] for r in missing if r in problems}
        if self.on_timeout == "fail" and corrupt:
            kinds = {type(exc) for exc in corrupt.values()}
            cls = kinds.pop() if len(kinds) == 1 else CorruptObjectError  # the most specific name
            raise cls(
                f"round {round_id}: invalid objects for ranks {sorted(corrupt)} after timeout_s="
                f"{self.timeout_s}: {'; '.join(map(str, corrupt.values()))}. They are never averaged; remove "
                "them or pass on_timeout='proceed' to continue without those replicas."
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

    def _cleanup(self, round_id: int, manifest: _Manifest) -> None:
        """Delete round ``round_id - keep_rounds`` (and any older one still stored) in the background:
        directory removal is a slow metadata operation on many filesystems, so it overlaps the next
        inner steps. One participant per round does it, ``ranks[round_id % n]`` of the manifest (so
        deletions cost one listing and one bulk delete per round, not per replica); a cleaner that
        died leaves its rounds to the next round's. One long-lived worker runs the deletions in order
        (no thread start per round); a round waits only when more than ``_CLEANUPS_QUEUED`` are
        behind. :meth:`rounds_present` and :meth:`cleanup_run` wait for all of them."""
        old = round_id - self.keep_rounds
        if old < 0 or manifest.ranks[round_id % len(manifest.ranks)] != self.rank:
            return
        if self._cleaner is None:  # not a daemon: the interpreter finishes queued deletions before exiting
            self._cleaner = ThreadPoolExecutor(1, thread_name_prefix="diloco-store-cleanup")
        self._cleanups = [f for f in self._cleanups if not f.done()]
        while len(self._cleanups) > _CLEANUPS_QUEUED:
            self._cleanups.pop(0).result()
        self._cleanups.append(self._cleaner.submit(self._remove_round, old))

    def _spare_ahead(self, next_round: int) -> None:
        """On a local filesystem, once this round is committed, create the next round's folder and temporary
        files (:meth:`_make_spares`: as many as this round took) in a worker of their own, off the critical path
        like the deletions and never queued behind one; not while the previous round's are still being made (the
        round then creates what it lacks)."""
        if not self._local or self._pid != os.getpid():
            return
        if self._sparing is not None and not self._sparing.done():
            return
        if self._sparer is None:
            self._sparer = ThreadPoolExecutor(
                1, thread_name_prefix="diloco-store-spares", initializer=_lowest_cpu_priority
            )
        self._sparing = self._sparer.submit(
            self._make_spares, self._tmp_taken, self.round_dir(next_round), self._fill_sizes
        )

    def _remove_round(self, old: int) -> None:
        """Delete every stored round up to ``old``."""
        try:
            if _is_s3(self.fs):
                fsspec.asyn.sync(self.fs.loop, self._s3_remove_rounds, old)
                return
            for r in self._rounds_listed():
                if r <= old:
                    with contextlib.suppress(FileNotFoundError):
                        self._remove_tree(self.round_dir(r))
        except Exception as exc:  # a failed cleanup leaves garbage, never a wrong average
            logger.warning("could not delete rounds up to %d of run %r: %s", old, self.run_id, exc)

    def _remove_tree(self, path: str) -> None:
        """Delete ``path`` and everything under it. On S3: one listing and one bulk delete per 1,000 keys
        (s3fs's recursive rm adds HEADs and listings)."""
        if _is_s3(self.fs):
            prefix = path.rstrip("/") + "/"
            fsspec.asyn.sync(self.fs.loop, self._s3_delete, prefix)
        else:
            self.fs.rm(path, recursive=True)

    def _s3_round_keys(self) -> list[tuple[str, str]]:
        """(round folder, name) of every object under the run's ``rounds/`` (one LIST per 1,000)."""
        prefix = self.key("rounds") + "/"
        keys: list[str] = fsspec.asyn.sync(self.fs.loop, self._s3_keys, prefix)
        pairs = [k[len(prefix) :].split("/") for k in keys]
        return [(p[0], p[1]) for p in pairs if len(p) == 2]

    async def _s3_keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (ending in ``/``), as ``bucket/key`` paths."""
        bucket, name, _ = self.fs.split_path(prefix)
        name = name.rstrip("/") + "/"
        keys: list[str] = []
        token: dict[str, Any] = {}
        while True:
            page = await self.fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=name, **token)
            keys += [f"{bucket}/{o['Key']}" for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return keys
            token = {"ContinuationToken": page["NextContinuationToken"]}

    async def _s3_remove_rounds(self, old: int) -> None:
        """Delete every object of rounds up to ``old``: one listing, one bulk delete per 1,000 keys."""
        prefix = self.key("rounds") + "/"
        folders = [(k, k[len(prefix) :].split("/", 1)[0]) for k in await self._s3_keys(prefix)]
        await self._s3_delete_keys([k for k, r in folders if r.isdigit() and int(r) <= old])
        self.fs.invalidate_cache(prefix.rstrip("/"))

    async def _s3_delete(self, prefix: str) -> None:
        """Delete every object under ``prefix`` (ending in ``/``)."""
        await self._s3_delete_keys(await self._s3_keys(prefix))
        self.fs.invalidate_cache(prefix.rstrip("/"))

    async def _s3_delete_keys(self, keys: Sequence[str]) -> None:
        """One bulk delete per 1,000 keys (``bucket/key`` paths of one bucket)."""
        for lo in range(0, len(keys), 1000):
            batch = keys[lo : lo + 1000]
            bucket = self.fs.split_path(batch[0])[0]
            objects = [{"Key": self.fs.split_path(k)[1]} for k in batch]
            await self.fs._call_s3(
                "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True}
            )

    def wait_cleanup(self) -> None:
        """Wait until the background work (deletions of old rounds, temporary files made ahead) has finished."""
        pending, self._cleanups = self._cleanups, []
        if self._sparing is not None:
            pending.append(self._sparing)
        for f in pending:
            f.result()  # _remove_round and _make_spares log their own failures: this never raises

    def cleanup_run(self) -> None:
        """Delete everything under this run's prefix (call once, after every replica finished)."""
        self.wait_cleanup()
        _drop_spares(self._spares, self._filled, self._trash, self._pid)
        for attempt in range(_RUN_REMOVALS):
            try:
                self._remove_tree(self.prefix)
                return
            except FileNotFoundError:
                return
            except OSError as exc:  # another replica's worker wrote a file ahead while its folder was emptied
                if exc.errno != errno.ENOTEMPTY or attempt == _RUN_REMOVALS - 1:
                    raise

    def rounds_present(self) -> list[int]:
        """Round numbers currently stored for this run (not a local folder made ahead for the next round)."""
        self.wait_cleanup()
        return self._rounds_stored()

    def _rounds_stored(self) -> list[int]:
        """:meth:`_rounds_listed`, less a local folder made ahead for the next round that is still empty."""
        rounds = self._rounds_listed()
        return [r for r in rounds if self._list(self.round_dir(r))] if self._local else rounds

    def _rounds_listed(self) -> list[int]:
        """Round numbers in the store's listing now (a round being deleted in the background may
        still show: only rounds newer than the one asked about count as evidence)."""
        return sorted(int(n) for n in self._list(self.key("rounds")) if n.isdigit())


def _non_finite(i: int, rank: int, round_id: int) -> ValueError:
    return ValueError(
        f"tensor {i} of rank {rank} in round {round_id} holds NaN/inf; refusing to publish "
        "it (it would poison every replica's average). Check the inner optimiser / loss."
    )


def _wire_form(
    t: object, i: int, rank: int, round_id: int, quantize: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any], torch.Tensor]:
    """(host tensor, wire tensor, layout entry, this replica's own contribution) of tensor ``i``.
    A contiguous CPU tensor is used in place (no copy)."""
    if not isinstance(t, torch.Tensor) or not torch.is_floating_point(t):
        raise ValueError(f"tensor {i} must be a floating-point torch.Tensor, got {type(t).__name__}.")
    # a CPU parameter is used as it is: detach/to/contiguous cost ~1 µs a tensor even when they change nothing
    plain = t.is_cpu and not t.requires_grad and t.is_contiguous()
    host = t if plain else t.detach().to("cpu").contiguous()
    entry: dict[str, Any] = {
        "shape": list(host.shape),
        "dtype": _DTYPE_NAMES.get(host.dtype) or str(host.dtype)[6:],
    }
    if quantize:  # a full-precision wire is checked for NaN/inf as it is hashed (_pack)
        if not _all_finite(host):
            raise _non_finite(i, rank, round_id)
        q, scale = quantize_fp8(host)
        entry.update(wire="float8_e4m3fn", scale=scale)
        return host, q, entry, dequantize_fp8(q, scale)
    entry.update(wire=entry["dtype"], scale=None)
    return host, host, entry, host


def _piece(t: torch.Tensor, s: int, k: int) -> torch.Tensor:
    """Shard ``s`` of ``k`` of a tensor: a contiguous 1/k slice of its flattened values (a view)."""
    flat = t.reshape(-1)
    n = flat.numel()
    return flat[n * s // k : n * (s + 1) // k]


def _sum_into(outs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], op: str) -> list[bool]:
    """``outs[i] = Σ_r inputs[r][i]`` in float32 in the given order, then ``/ n`` for avg (the
    full and the sharded exchange share this arithmetic, so both give the same bits); an element whose float32
    running sum overflows although its average is finite gets that average (:func:`_mend`). Returns whether
    each result is finite (known from the mend's one read: no second pass)."""
    divisor = len(inputs) if op == "avg" else 1
    finite = []
    for i, out in enumerate(outs):
        fix = _average_into(out, [x[i] for x in inputs], divisor)
        finite.append(fix is None or bool(torch.isfinite(fix[1]).all()))
    return finite


def _average_into(
    out: torch.Tensor, inputs: Sequence[torch.Tensor], divisor: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``out ← Σ inputs / divisor`` in float32 in the given order, the elements whose sum overflowed mended
    (:func:`_mend`); the mend, or None."""
    _sum(out, inputs)
    fix = _mend(out, inputs, divisor)
    if divisor > 1:
        out.div_(divisor)
    if fix is not None:
        out[fix[0]] = fix[1]
    return fix


def _sum(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> None:
    """``out = Σ inputs`` in float32, in the given order."""
    first, rest = inputs[0].reshape(-1), [x.reshape(-1) for x in inputs[1:]]
    if rest and first.dtype == rest[0].dtype == torch.float32:
        torch.add(first, rest[0], out=out)  # one pass instead of copy + add
        rest = rest[1:]
    else:
        out.copy_(first)
    for x in rest:
        out.add_(x)


def _mend(
    acc: torch.Tensor, inputs: Sequence[torch.Tensor], divisor: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where the float32 sums ``acc`` of finite ``inputs`` overflowed: (those indices, ``Σ inputs / divisor``
    there, summed in float64 in the same order and rounded to float32, which is finite for an average and may
    not be for a sum). None when every sum is finite: one read of ``acc`` (in cache on the piecewise path).
    Elementwise, so the result does not depend on how the tensors are cut into pieces or shards."""
    if _all_finite(acc):
        return None
    where = torch.isfinite(acc).logical_not_().nonzero().view(-1)
    wide = torch.zeros(where.numel(), dtype=torch.float64)
    for x in inputs:
        wide += x.reshape(-1)[where].to(torch.float64)
    return where, (wide / divisor).to(torch.float32)


def _overflow_message(round_id: int, what: str, op: str) -> str:
    if op == "avg":  # only float64 contributions beyond float32's range get here
        fix = "the exchange averages in float32: keep float64 tensors within float32's range (±3.4e38)."
    else:
        fix = (
            "scale the tensors down, or use op='avg' (an average of finite float32 values is always applied)."
        )
    return (
        f"round {round_id}: {what} is finite in every contribution but their sum overflows float32 (op={op!r}); "
        f"no replica applies it and no tensor changed: {fix}"
    )


def _direct_targets(tensors: Sequence[torch.Tensor]) -> set[int]:
    """Indices of the contiguous CPU targets whose memory no other target shares (tied weights passed
    twice, views of one buffer): those can be written while the inputs of later targets are still read. Not
    float64 ones: they may hold values beyond float32, whose float32 average is inf, and :meth:`_stage` checks
    its results before any write."""
    owners: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        # the storage's address, without building its Python object (untyped_storage(): ~5 µs a tensor)
        owners.setdefault(t.data_ptr() - int(t.storage_offset()) * t.element_size(), []).append(i)
    return {
        i
        for i, t in ((ix[0], tensors[ix[0]]) for ix in owners.values() if len(ix) == 1)
        if t.is_cpu and t.is_contiguous() and t.dtype != torch.float64
    }


def _reduce_pieces(
    t: torch.Tensor, inputs: Sequence[torch.Tensor], divisor: int, scratch: torch.Tensor
) -> None:
    """``t ← Σ inputs / divisor`` through ``scratch``, a float32 piece of ``_REDUCE_PIECE`` elements (it stays
    in cache; the caller keeps it across rounds): the arithmetic of :func:`_sum_into` + :func:`_apply`, piece
    by piece, for an average (whose mended elements are always finite). An input that is ``t`` itself (this
    replica's own contribution) is read piece by piece before that piece is written."""
    flat, flats = t.view(-1), [x.reshape(-1) for x in inputs]
    for lo in range(0, flat.numel(), _REDUCE_PIECE):
        hi = min(lo + _REDUCE_PIECE, flat.numel())
        piece, column = scratch[: hi - lo], [x[lo:hi] for x in flats]
        _sum(piece, column)
        fix = _mend(piece, column, divisor)  # before the write below: an input may be t
        _apply(flat[lo:hi], piece, divisor)
        if fix is not None:
            flat[lo:hi][fix[0]] = fix[1].to(t.dtype)


def _bucketable(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether the direct target ``t`` is averaged in a bucket with others (:func:`_reduce_bucket`): small, and
    it and its inputs float32."""
    return (
        t.numel() <= _BUCKET_TENSOR
        and t.dtype == torch.float32
        and all(x.dtype == torch.float32 and x.is_cpu for x in inputs)
    )


def _runs(items: Sequence[_T], sizes: Sequence[int], limit: int) -> list[list[_T]]:
    """``items`` cut, in order, into runs whose ``sizes`` add up to at most ``limit`` (an item larger than
    ``limit`` makes a run of its own)."""
    out: list[list[_T]] = []
    total = 0
    for item, n in zip(items, sizes):
        if not out or total + n > limit:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n
    return out


def _reduce_bucket(
    targets: Sequence[torch.Tensor],
    columns: Sequence[Sequence[torch.Tensor]],
    divisor: int,
    scratch: torch.Tensor,
) -> None:
    """``targets[j] ← Σ_r columns[r][j] / divisor`` for small float32 targets at once: each input's tensors are
    flattened into one buffer (in cache), then summed into ``scratch``, mended, divided and copied back, one call
    each, not one per tensor (a 200-tensor round spent ~15 µs a tensor in per-call overhead, 5 µs gathering with
    ``torch.cat``). Elementwise, so the bits are :func:`_reduce_pieces`'."""
    flats = [flatten_dense_tensors(list(column)) for column in columns]  # reads the targets before any write
    piece = scratch[: flats[0].numel()]
    _average_into(piece, flats, divisor)
    torch._foreach_copy_(list(targets), unflatten_dense_tensors(piece, list(targets)))


def _apply(t: torch.Tensor, acc: torch.Tensor, divisor: int) -> None:
    """``t ← acc / divisor`` (float32 division, then cast to t's dtype/device); a float32
    contiguous CPU ``t`` receives the quotient directly (no extra pass)."""
    if divisor == 1:
        t.copy_(acc.view(t.shape))
    elif t.dtype == torch.float32 and t.is_cpu and t.is_contiguous():
        torch.div(acc, divisor, out=t.view(-1))
    else:
        t.copy_(acc.div_(divisor).view(t.shape))


def _shard_count(
    indexes: Mapping[int, _Decoded], ranks: Sequence[int], world_size: int, round_id: int
) -> int:
    counts = {int(indexes[r].meta.get("shards", -1)) for r in ranks}
    if counts != {world_size}:
        raise CorruptObjectError(
            f"round {round_id}: the committed indexes split the tensors into {sorted(counts)} shards, "
            f"expected world_size={world_size}: every replica must run with the same world_size."
        )
    return world_size


def _all_finite(t: torch.Tensor) -> bool:
    """One reduction pass: a finite float32 sum proves every value finite; only when it is not
    (NaN/inf, or a huge but finite tensor whose sum overflows) are the values checked one by one."""
    if t.numel() == 0:
        return True
    if t.dtype == torch.float8_e4m3fn:
        t = t.to(torch.float32)
    if math.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).item()):
        return True  # a host float read (no isfinite operator): 17 against 29 us a 1 MiB piece
    return bool(torch.isfinite(t).all())


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in row-major order: a view of its memory when it is contiguous. Through numpy's
    buffer where numpy has the dtype (~0.7 µs a tensor, against 2.2 µs through a reshape and a uint8 view)."""
    if t.numel() == 0:
        return memoryview(b"")
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype not in _NUMPY_DTYPES:  # bfloat16, float8: numpy has no such dtype, its bytes do
        t = t.reshape(-1).view(torch.uint8)
    array: Any = t.numpy()
    return memoryview(array).cast("B")


def _u32(n: int) -> bytes:
    return n.to_bytes(4, "little")


class _Hasher:
    """One chunk's checksum, fed piece by piece: XXH3-64 (8 bytes, big-endian), or SHA-256 for signed objects."""

    def __init__(self, signed: bool) -> None:
        self._h: Any = hashlib.sha256() if signed else xxhash.xxh3_64()

    @staticmethod
    def width(signed: bool) -> int:
        return _DIGEST if signed else 8

    def update(self, piece: memoryview) -> None:
        self._h.update(piece)

    def digest(self) -> bytes:
        return bytes(self._h.digest())

    @staticmethod
    def of(signed: bool, piece: memoryview) -> bytes:
        """The checksum of one piece, in one call (the same bytes as update + digest, ~1 µs less a piece)."""
        return hashlib.sha256(piece).digest() if signed else xxhash.xxh3_64_digest(piece)


def _split(body: memoryview, sizes: Sequence[int]) -> list[memoryview]:
    """``body`` cut into consecutive views of ``sizes`` bytes (their sum is ``len(body)``)."""
    out, offset = [], 0
    for n in sizes:
        out.append(body[offset : offset + n])
        offset += n
    return out


def _pieces(views: Sequence[memoryview], size: int) -> list[tuple[int, memoryview]]:
    """Every view cut into pieces of at most ``size`` bytes (zero-copy), each with its view's index; an empty
    view has none."""
    return [
        (i, v) if 0 < v.nbytes <= size else (i, v[lo : lo + size])
        for i, v in enumerate(views)
        for lo in range(0, v.nbytes, size)
    ]


def _checkable(meta: Mapping[str, Any], chunk: int) -> list[torch.dtype | None]:
    """Per tensor of a decoded header, the dtype its wire bytes are checked for finite values as (None: after
    decoding instead, for a quantized object or a layout whose pieces would not hold whole values)."""
    out: list[torch.dtype | None] = []
    for entry in meta["layout"]:
        wire = entry.get("wire") if isinstance(entry, dict) else None
        dtype = _DTYPES.get(wire) if isinstance(wire, str) else None
        whole = (
            dtype is not None and chunk % dtype.itemsize == 0 and int(entry["nbytes"]) % dtype.itemsize == 0
        )
        # quantized (fp8) values are checked after dequantizing, as the decoded tensors
        out.append(dtype if whole and not meta.get("quantized") and dtype != torch.float8_e4m3fn else None)
    return out


def _scan_chunk(signed: bool, chunk: memoryview, dtype: torch.dtype | None) -> tuple[bytes, bool]:
    """A chunk's checksum, and whether its values read as ``dtype`` are all finite (True when ``dtype`` is None):
    each piece of at most ``_SCAN_BYTES`` is hashed, then checked while it is still in cache."""
    if chunk.nbytes <= _SCAN_BYTES:  # one piece (every small tensor): no hasher object, no loop
        digest = _Hasher.of(signed, chunk)
        return digest, dtype is None or _all_finite(_frombuffer(chunk, chunk.nbytes, 0, dtype))
    h, finite = _Hasher(signed), True
    for lo in range(0, chunk.nbytes, _SCAN_BYTES):
        piece = chunk[lo : lo + _SCAN_BYTES]
        h.update(piece)
        if dtype is not None and finite:
            finite = _all_finite(_frombuffer(piece, piece.nbytes, 0, dtype))
    return h.digest(), finite


def _scan(
    signed: bool,
    pieces: Sequence[tuple[int, memoryview]],
    dtypes: Sequence[torch.dtype | None],
    write: Callable[[memoryview], object] | None,
    parallel: bool,
) -> tuple[bytes, list[bool | None]]:
    """The checksum table of ``pieces`` (:func:`_pieces`), and per view whether its values (read as its dtype)
    are all finite (None where its dtype is None). Pieces are scanned in parallel threads on large payloads
    (xxhash, hashlib and torch release the GIL), so a large object costs one read of its bytes from memory,
    spread over the cores, when ``parallel`` (:attr:`ObjectStoreAllReduce.checksum_parallel`: 2 cores or more per
    replica on this machine). With ``write`` (:func:`_streamed`), each piece is written after it is scanned, and
    the scan stops at the first non-finite piece, which is not written. Pieces below ``_RUN_CHECK_BYTES`` are only
    hashed there and checked together afterwards (:func:`_non_finite_small`): a non-finite one may be written,
    and the caller refuses the object before it is published."""

    def one(piece: tuple[int, memoryview]) -> tuple[bytes, bool]:
        i, view = piece
        return _scan_chunk(signed, view, None if _checked_in_runs(view) else dtypes[i])

    serial = not parallel or len(pieces) < 2 or sum(p.nbytes for _, p in pieces) < _PARALLEL_BYTES
    if write is not None:
        results = _streamed(one, pieces, write, serial)
    else:
        results = list(map(one, pieces) if serial else _pool().map(one, pieces))
    finite: list[bool | None] = [None if d is None else True for d in dtypes]
    for (i, _), (_, ok) in zip(pieces, results):
        if not ok:
            finite[i] = False
    if len(results) == len(pieces):  # else a streamed write stopped at a non-finite piece: refused already
        for i in _non_finite_small(pieces, dtypes):
            finite[i] = False
    return b"".join(digest for digest, _ in results), finite


def _checked_in_runs(view: memoryview) -> bool:
    """Whether a piece is checked for NaN/inf with others (:func:`_non_finite_small`), not right after its hash."""
    return view.nbytes < _RUN_CHECK_BYTES


def _non_finite_small(
    pieces: Sequence[tuple[int, memoryview]], dtypes: Sequence[torch.dtype | None]
) -> list[int]:
    """The views among ``pieces`` below ``_RUN_CHECK_BYTES`` (a whole view each) whose values, read as their
    dtype, hold NaN/inf. Per dtype, the pieces are joined into runs of at most ``_SCAN_BYTES`` (a buffer that
    stays in cache), each checked by one reduction; a run that fails is checked piece by piece, to name the
    tensor."""
    groups: dict[torch.dtype, list[tuple[int, memoryview]]] = {}
    for i, view in pieces:
        dtype = dtypes[i]
        if dtype is not None and _checked_in_runs(view):
            groups.setdefault(dtype, []).append((i, view))
    bad: list[int] = []
    for dtype, small in groups.items():
        for run in _runs(small, [v.nbytes for _, v in small], _SCAN_BYTES):
            if not _all_finite(torch.frombuffer(bytearray().join(v for _, v in run), dtype=dtype)):
                bad.extend(i for i, v in run if not _all_finite(_frombuffer(v, v.nbytes, 0, dtype)))
    return bad


def _streamed(
    one: Callable[[tuple[int, memoryview]], tuple[bytes, bool]],
    pieces: Sequence[tuple[int, memoryview]],
    write: Callable[[memoryview], object],
    serial: bool,
) -> list[tuple[bytes, bool]]:
    """``one`` of each piece, then ``write`` of it while it is still in cache, in order: the payload is read
    from memory once (one replica alone on ``file://``, publishing 64 MiB took 25-27 ms hashed then written,
    19-20 ms streamed). Unless ``serial``, the pool scans the next piece while this thread writes the current
    one. Stops at the first non-finite piece (unwritten); nothing is left running on return."""
    results: list[tuple[bytes, bool]] = []
    ahead: Future[tuple[bytes, bool]] | None = None
    try:
        for k, piece in enumerate(pieces):
            if serial:
                result = one(piece)
            else:
                result = (ahead or _pool().submit(one, piece)).result()
                ahead = _pool().submit(one, pieces[k + 1]) if k + 1 < len(pieces) and result[1] else None
            results.append(result)
            if not result[1]:
                break
            write(piece[1])
    finally:
        if ahead is not None and not ahead.cancel():
            ahead.exception()  # a scan of the next piece already running: let it end
    return results


@functools.cache
def _machine() -> str:
    """This machine's anonymous fingerprint: 16 hex digits of SHA-256 of the kernel's boot id (shared by every
    container and process on the host, so by every replica that shares its cores), else of the host name. Objects
    carry it so that replicas count how many of them share this machine; it names no host."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            ident = f.read().strip()
    except OSError:
        ident = socket.gethostname().encode()
    return hashlib.sha256(b"composer-diloco machine " + ident).hexdigest()[:16]


def _usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _pool() -> ThreadPoolExecutor:
    """The process's checksum threads (started on first use)."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="diloco-checksum")
    return _POOL


def _frombuffer(buf: memoryview, nbytes: int, offset: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """``nbytes`` bytes of ``buf`` from ``offset`` (a multiple of ``dtype``'s size) as a 1-D ``dtype`` tensor over
    that memory, no copy (read as ``dtype`` directly: a uint8 tensor viewed as it took 2.2 against 0.7 µs)."""
    if not nbytes:
        return torch.empty(0, dtype=dtype)
    if offset + nbytes > len(buf):
        raise ValueError(f"{nbytes} bytes at offset {offset} exceed the object's {len(buf)} bytes")
    count = nbytes // dtype.itemsize
    if not buf.readonly:  # mapped objects, read buffers, tensors' memory: no warning to silence
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    # read-only bytes from the store: these tensors are only read (~10 µs: once per tensor cost 2 ms a round at
    # 200 tensors, hence only here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


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


class _Secret:
    """Holds the HMAC key; its repr never shows it (reprs end up in logs and tracebacks)."""

    __slots__ = ("value",)

    def __init__(self, value: bytes) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "_Secret(<redacted>)"

    def __reduce__(self) -> Any:
        raise TypeError("the HMAC key is not picklable: every replica reads it from its own environment.")


def _hmac_key(env: str, required: bool) -> bytes | None:
    """The shared HMAC secret from ``$env`` (its value never appears in any message)."""
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
    return key


def _canonical(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _check_round(round_id: int) -> int:
    if not isinstance(round_id, int) or isinstance(round_id, bool) or round_id < 0:
        raise ValueError(f"round_id must be an int >= 0, got {round_id!r}.")
    return round_id


def _is_s3(fs: Any) -> bool:
    """s3fs (its async API streams uploads and downloads without full-size copies)."""
    return "s3" in _protocols(fs) and hasattr(fs, "_call_s3")


class _Stream(io.RawIOBase):
    """Bytes ``[lo, hi)`` of the concatenation of ``views``, as a seekable file (an upload body
    read straight from the tensors' memory; botocore seeks back to retry)."""

    def __init__(self, views: Sequence[memoryview], lo: int = 0, hi: int | None = None) -> None:
        self._views = [v.cast("B") if v.format != "B" else v for v in views]
        total = sum(v.nbytes for v in self._views)
        self._lo, self._hi = lo, total if hi is None else hi
        self._pos = 0

    def __len__(self) -> int:
        return self._hi - self._lo

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self)}[whence]
        self._pos = max(0, min(len(self), base + offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        pos, n, start = self._lo + self._pos, 0, 0
        for v in self._views:
            end = start + v.nbytes
            if pos < end and n < len(out) and pos < self._hi:
                k = min(end - pos, len(out) - n, self._hi - pos)
                out[n : n + k] = v[pos - start : pos - start + k]
                n, pos = n + k, pos + k
            start = end
        self._pos += n
        return n


def _libc(name: str, argtypes: list[Any]) -> Any:
    """libc's function ``name``, taking ``argtypes`` and returning an int (errno kept), or None where libc has
    no such function."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError, TypeError):  # not Linux/glibc (TypeError: Windows' CDLL(None))
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


# Linux, glibc 2.28 and later
_RENAMEAT2 = _libc("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])
_AT_FDCWD = -100  # paths relative to the working directory (ours are absolute)
_RENAME_EXCHANGE = 2  # <linux/fs.h>: swap the two names atomically, both must exist


def _inotify() -> tuple[Any, Any, Any] | None:
    """libc's ``inotify_init1``, ``inotify_add_watch`` and ``inotify_rm_watch`` (Linux), or None."""
    fns = (
        _libc("inotify_init1", [ctypes.c_int]),
        _libc("inotify_add_watch", [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]),
        _libc("inotify_rm_watch", [ctypes.c_int, ctypes.c_int]),
    )
    return None if any(fn is None for fn in fns) else fns


_INOTIFY = _inotify()
_IN_CREATE, _IN_MOVED_TO, _IN_ONLYDIR = 0x100, 0x80, 0x01000000  # <sys/inotify.h>
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, getattr(os, "O_CLOEXEC", 0)


class _FolderWatch:
    """Wakes a local replica that waits for another's file as soon as a name is made in the folder it watches
    (Linux inotify): a link or a rename into it. A wait still ends at its timeout, so where inotify does not see
    the other writers (a network filesystem written from other machines) waiting is sleeping, as without it."""

    def __init__(self) -> None:
        if _INOTIFY is None:
            raise OSError(errno.ENOSYS, "no inotify here")
        init1, self._add, self._rm = _INOTIFY
        self._fd = init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._wd, self._folder = -1, ""

    def watch(self, folder: str) -> bool:
        """Watch ``folder`` (only it: another one watched before is left); False if it cannot be watched (missing,
        or no watches left)."""
        if self._wd >= 0 and folder == self._folder:
            return True
        self.unwatch()
        self._wd = self._add(self._fd, os.fsencode(folder), _IN_CREATE | _IN_MOVED_TO | _IN_ONLYDIR)
        self._folder = folder
        return self._wd >= 0

    def wait(self, seconds: float) -> None:
        """Until a name is made in the watched folder, or ``seconds`` pass."""
        if select.select([self._fd], [], [], seconds)[0]:
            self._drain()

    def unwatch(self) -> None:
        """Stop watching (nothing if nothing is watched); events still queued are dropped."""
        if self._wd < 0:
            return
        self._rm(self._fd, self._wd)
        self._wd = -1
        self._drain()

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._fd, 1 << 16):
                pass

    def close(self) -> None:
        os.close(self._fd)


def _lowest_cpu_priority() -> None:
    """Run the calling thread at nice 19 (Linux sets a thread's nice value on its own; elsewhere nothing is done).
    For the worker that makes the next round's files: its work is needed only by the next round, and at the
    replicas' priority it took a core from a replica still finishing this one (2 replica processes on 2 cores,
    rounds back to back: a 1 MiB round's span 10-14% shorter with it at nice 19; no change measured when dirty
    pages were flushed before each round, as the bench does). Not for the deletions' worker: at nice 19 the span
    was 2-4% longer (preempted while holding the GIL, it held up its own replica's end of the round)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _drop_spares(
    spares: list[tuple[str, io.BufferedWriter]],
    filled: list[tuple[str, io.BufferedWriter, int]],
    trash: list[str],
    pid: int,
) -> None:
    """Close and delete a store's spare temporary files (``filled``: those holding zeros) and its spent temporary
    names (when it is collected, at exit, or by cleanup_run); in a forked child of process ``pid``, which they
    belong to, nothing."""
    if os.getpid() != pid:
        return
    _unlink_all(trash)
    for pool in (spares, filled):
        while pool:
            tmp, f, *_ = pool.pop()
            f.close()
            trash.append(tmp)
    _unlink_all(trash)


def _in_folder(op: Callable[[], _T], folder: str, parents: bool = True) -> _T:
    """``op()`` (a file operation into ``folder``), once more after making ``folder`` if it failed for want of it:
    the folder is made only when missing, not before every write. Without ``parents`` it is made only inside an
    existing one (FileNotFoundError otherwise)."""
    try:
        return op()
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):
            os.makedirs(folder) if parents else os.mkdir(folder)
        return op()


def _unlink_all(names: list[str]) -> None:
    """Delete the files ``names`` lists, emptying it (one at a time: another thread may append meanwhile)."""
    while names:
        with contextlib.suppress(OSError):
            os.unlink(names.pop())


def _protocols(fs: Any) -> set[str]:
    proto = fs.protocol
    return {proto} if isinstance(proto, str) else set(proto)


def _full_layout(d: _Decoded) -> list[dict[str, Any]]:
    """The tensors an object stands for (a sharded index lists them under ``tensors``)."""
    return list(d.meta["tensors"] if d.meta.get("kind") == "index" else d.meta["layout"])


def _check_layouts(decoded: Mapping[int, _Decoded], ranks: Sequence[int], round_id: int) -> None:
    def shapes(r: int) -> list[tuple[Any, ...]]:
        return [(tuple(e["shape"]), e["dtype"], e["wire"]) for e in _full_layout(decoded[r])]

    ref_rank = ranks[0]
    ref = shapes(ref_rank)
    for r in ranks[1:]:
        if shapes(r) != ref:
            raise ObjectStoreError(
                f"round {round_id}: rank {r} sent tensors {shapes(r)} but rank {ref_rank} sent {ref}; "
                "every replica must all-reduce the same parameters in the same order (same model, same fragments)."
            )


def _check_targets(ref: _Decoded, tensors: Sequence[torch.Tensor], round_id: int) -> None:
    """The caller's tensors must have the committed objects' shapes (e.g. when adopting)."""
    shapes = [tuple(e["shape"]) for e in _full_layout(ref)]
    mine = [tuple(t.shape) for t in tensors]
    if shapes != mine:
        raise ObjectStoreError(
            f"round {round_id} was committed with tensors of shapes {shapes} but this replica passes "
            f"{mine}; every replica must all-reduce the same parameters in the same order."
        )
