"""ObjectStoreAllReduce: an all-reduce through any fsspec filesystem, with no network path
between replicas (``file://``, ``memory://``, ``s3://``, ``gs://``, …).

The invariant: **every replica that completes round r applies the same average, or fails with an
error naming why.** The round's committed manifest is its single source of truth. One round, for
replica ``rank`` of ``world_size``:

1. If round r already has a manifest (a replica re-running a committed round, or a straggler the
   round went on without), adopt it: average exactly the objects it lists, never this replica's
   new values. If it has none but the run has evidently moved past r, raise
   :class:`RoundExpiredError` (restart from a checkpoint); nothing is written then. A replica *in step*
   (it completed round r - 1 and calls round r) skips this check: its proposal loses to a committed
   manifest and reads it back, its listing shows a committed manifest or a later round (then the check
   runs), and a marker that went on from r under another manifest names the round expired. On
   :class:`RoundExpiredError` it deletes what it wrote into r and takes back its marker entry.
2. Encode the tensors into one object (:mod:`.codec`: a header, one checksum over the body, a tag =
   SHA-256 or, with ``$COMPOSER_DILOCO_HMAC_KEY``, HMAC-SHA256 of the header) and *create*
   ``<root>/<run_id>/rounds/<round>/rank-<rank>.bin`` create-only (:mod:`.backend`). Objects are
   immutable: a replica whose object for r exists already contributes the stored object.
3. Read the other ranks' objects (first directly, then by polling a listing of the run's rounds) and
   validate each (magic, tag, checksum, run, round, rank, world size, layout, finite values).
4. When every rank is present, or when ``timeout_s`` passes, propose the participant set by *creating*
   ``manifest.json`` (:mod:`.manifest`); the first proposal wins and every replica averages exactly those
   objects. On timeout, ``on_timeout="proceed"`` goes on with the replicas present (at least
   ``min_replicas``); ``"fail"`` raises :class:`StragglerTimeoutError`.
5. Record the manifest in this replica's progress marker, then check the others' markers
   (:class:`RoundConflictError` if one accepted another manifest for r).
6. Average in float32 in rank order (:mod:`.reduce`) into the caller's tensors; one participant per
   round (``ranks[r % n]``) deletes the rounds older than ``keep_rounds`` in a background thread.

``exchange="sharded"`` is a reduce-scatter + all-gather under the same rules (:mod:`.sharded`). Every key
is built from validated parts and checked to stay under ``<root>/<run_id>/``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import fsspec
import torch

from .backend import S3_PART_BYTES, S3_PARTS_IN_FLIGHT, protocols
from .codec import HMAC_KEY_ENV, Decoded, Encoded, read_hmac_key
from .errors import (
    CorruptObjectError,
    Laps,
    NonFiniteResultError,
    ObjectStoreError,
    RoundExpiredError,
    RoundStats,
    StragglerTimeoutError,
    safe_part,
)
from .manifest import Manifest
from .reduce import (
    REDUCE_PIECE,
    apply,
    bucketable,
    check_layouts,
    check_targets,
    direct_targets,
    overflow_message,
    reduce_bucket,
    reduce_pieces,
    runs,
    sum_into,
)
from .sharded import Sharded

logger = logging.getLogger("composer_diloco.object_store")
_FIRST_POLL_S = 0.001  # polls of a remote store start here and double up to poll_interval_s
_FIRST_LOCAL_POLL_S = 0.00005  # a local listing costs tens of µs: small rounds must not wait out 1 ms sleeps
_PROPOSAL_LOOKS = 4  # reads of the manifest rank min(ranks) proposes, before the others propose too
_CLEANUPS_QUEUED = 2  # deletions allowed to wait behind the running one before a round waits for them


class ObjectStoreAllReduce(Sharded):
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
        self._hmac = read_hmac_key(hmac_key_env, require_hmac)
        self.exchange = exchange
        self._buffers: dict[str, bytearray] = {}  # read buffers reused across rounds (local stores)
        self._bodies: dict[str, bytearray] = {}  # bodies of S3 writes, reused across rounds
        self._acc: list[torch.Tensor] = []  # float32 accumulators reused across rounds
        self._scratch: torch.Tensor | None = None  # the direct average's float32 piece, kept across rounds
        # a local filesystem's paths are the OS's: small reads and listings skip fsspec
        self._local = "file" in protocols(self.fs)
        self._memory = "memory" in protocols(self.fs)  # create-only emulated under a process-wide lock
        self._s3 = "s3" in protocols(self.fs)
        self._first_poll_s = _FIRST_LOCAL_POLL_S if self._local else _FIRST_POLL_S
        self._cleaner: ThreadPoolExecutor | None = None  # one worker: deletions run one at a time, in order
        self._cleanups: list[Future[None]] = []
        self._marker: dict[int, str] | None = None  # this replica's progress marker, as last written
        self._next_round: int | None = None  # the round after the one this instance last completed
        self._proposed: int | None = None  # the round whose manifest this call created (see _discard)
        self.s3_part_bytes = S3_PART_BYTES  # multipart part size on S3 (s3fs's pipe_file chunksize)
        self.s3_parts_in_flight = S3_PARTS_IN_FLIGHT  # multipart parts uploading at once

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
        laps = Laps()
        written0, read0 = self.bytes_written, self.bytes_read
        # In step (this instance completed round r - 1), nothing of round r is this replica's yet: the
        # committed-round check rides on the wait and the markers (module docstring, step 1).
        in_step, self._next_round, self._proposed = self._next_round == round_id, None, None
        problems: dict[int, CorruptObjectError] = {}
        manifest = None if in_step else self._committed(round_id)
        laps("commit")
        own: Decoded | None = None
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
        manifest: Manifest,
        decoded: dict[int, Decoded],
        tensors: Sequence[torch.Tensor],
        local: Decoded | None,
        op: str,
        laps: Laps,
    ) -> None:
        """Read the committed objects, record acceptance (:meth:`_accept`), then write the result
        into ``tensors``: nothing changes before every check has passed. ``laps`` times the phases."""
        inputs = self._gather(round_id, manifest, decoded)
        participants = manifest.ranks
        check_layouts(inputs, participants, round_id)
        check_targets(inputs[participants[0]], tensors, round_id)
        with torch.no_grad():
            if self.exchange == "sharded":
                sums = self._sharded_result(round_id, manifest, inputs, local, op)
                laps("reduce")
                self._accept(round_id, manifest)
                laps("accept")
                for t, acc in zip(tensors, sums):
                    apply(t, acc, 1)
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
    ) -> tuple[Decoded, bool]:
        """Publish this replica's object (full) or shards + index (sharded); True if an object
        published earlier (a re-run of the round) is the contribution instead."""
        if self.exchange == "sharded":
            index, own = self._encode_sharded(round_id, tensors, quantize)
            mine, reused = self._publish(round_id, index, own)
            return mine, reused
        data, own = self._encode(round_id, tensors, quantize)
        return self._publish(round_id, data, own)

    def _stage(
        self,
        round_id: int,
        tensors: Sequence[torch.Tensor],
        inputs: Sequence[Sequence[torch.Tensor]],
        op: str,
    ) -> dict[int, torch.Tensor]:
        """The results of the targets that are not written piece by piece (:func:`direct_targets`; under
        ``op="sum"``, whose result may be beyond float32, every target), by index, computed into the accumulators
        and checked: raises :class:`NonFiniteResultError` before any tensor changes."""
        direct = set() if op == "sum" else direct_targets(tensors)
        rest = [i for i in range(len(tensors)) if i not in direct]
        if not rest:
            return {}
        sums, finite = self._reduce([[x[i] for i in rest] for x in inputs], op)
        if not all(finite):
            raise NonFiniteResultError(overflow_message(round_id, f"tensor {rest[finite.index(False)]}", op))
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
        float32 scratch (:func:`reduce_pieces`: no payload-sized accumulator, one pass less), small float32 ones
        several at a time (:func:`reduce_bucket`). The same bits either way."""
        for i, acc in staged.items():
            apply(tensors[i], acc, 1)
        divisor = len(inputs) if op == "avg" else 1
        if self._scratch is None:  # a fresh one per round cost its page faults every round
            self._scratch = torch.empty(REDUCE_PIECE, dtype=torch.float32)
        rest = [i for i in range(len(tensors)) if i not in staged]
        small = [i for i in rest if bucketable(tensors[i], [x[i] for x in inputs])]
        for bucket in runs(small, [tensors[i].numel() for i in small], REDUCE_PIECE):
            columns = [[x[i] for i in bucket] for x in inputs]
            reduce_bucket([tensors[i] for i in bucket], columns, divisor, self._scratch)
        for i in sorted(set(rest) - set(small)):
            reduce_pieces(tensors[i], [x[i] for x in inputs], divisor, self._scratch)

    def _reduce(
        self, inputs: Sequence[Sequence[torch.Tensor]], op: str
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """``Σ x_r`` in float32 in the given (rank) order, then ``/ n`` for ``avg`` (:func:`sum_into`): the
        order torchft's gloo path uses, and whether each result is finite. Accumulators are reused across
        rounds."""
        shapes = [t.numel() for t in inputs[0]]
        if [a.numel() for a in self._acc] != shapes:
            self._acc = [torch.empty(n, dtype=torch.float32) for n in shapes]
        return self._acc, sum_into(self._acc, inputs, op)

    def _publish(self, round_id: int, data: Encoded, own: Decoded) -> tuple[Decoded, bool]:
        """Create this replica's object; if it exists already (a re-run of the round), return the
        stored one: objects are immutable, other replicas may have read it. True if reused."""
        key = self.object_key(round_id, self.rank)
        created = self.put_if_absent(key, data, slot="obj")
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

    def _gather(self, round_id: int, manifest: Manifest, decoded: dict[int, Decoded]) -> dict[int, Decoded]:
        """The committed objects: each participant's object with the tag the manifest lists."""
        out = {r: decoded[r] for r in manifest.ranks if r in decoded and decoded[r].tag == manifest.tags[r]}
        ranks = [r for r in manifest.ranks if r not in out]
        keys = [self.object_key(round_id, r) for r in ranks]
        for r, key, raw in zip(ranks, keys, self._read_many(keys, [f"obj-{r}" for r in ranks])):
            if raw is None:
                raise self._expired(round_id, f"its manifest lists rank {r}", f"{key} is gone")
            out[r] = self.decode(raw, round_id=round_id, rank=r, key=key)
            if out[r].tag != manifest.tags[r]:
                raise CorruptObjectError(
                    f"object {key} is not the one committed in round {round_id}'s manifest (its tag "
                    "differs): it was replaced after the round was committed. Objects are create-only; "
                    "something else writes to this run's prefix."
                )
        return {r: out[r] for r in manifest.ranks}

    def _await_manifest(
        self, round_id: int, decoded: dict[int, Decoded], problems: dict[int, CorruptObjectError]
    ) -> Manifest:
        """Collect the other ranks' objects until all are present or ``timeout_s`` passes, then
        propose the participant set. The first look reads the missing objects directly (no listing:
        replicas in step find them there). Each later look lists first: it finds a manifest committed
        meanwhile (the round went on without this replica: adopt it) and notices a run that has left this
        round (a later round exists: the committed manifest, or :class:`RoundExpiredError` when it is gone)."""
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
            self._pause(min(delay, self.poll_interval_s, max(0.0, deadline - time.monotonic())))
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

    def _await_proposal(self, round_id: int) -> Manifest | None:
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

    def _propose(self, round_id: int, decoded: Mapping[int, Decoded]) -> Manifest:
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
        decoded: dict[int, Decoded],
        problems: dict[int, CorruptObjectError],
    ) -> None:
        """Read (at once on an object store: :meth:`_read_many`) and validate the objects of ``ranks`` that exist
        now."""
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
        if self._s3:
            keys = self._round_keys()
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
        self, round_id: int, decoded: Mapping[int, Decoded], problems: Mapping[int, CorruptObjectError]
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

    def _cleanup(self, round_id: int, manifest: Manifest) -> None:
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

    def _remove_round(self, old: int) -> None:
        """Delete every stored round up to ``old``."""
        try:
            self._remove_rounds(old)
        except Exception as exc:  # a failed cleanup leaves garbage, never a wrong average
            logger.warning("could not delete rounds up to %d of run %r: %s", old, self.run_id, exc)

    def wait_cleanup(self) -> None:
        """Wait until the deletions of old rounds running in the background have finished."""
        pending, self._cleanups = self._cleanups, []
        for f in pending:
            f.result()  # _remove_round logs its own failures: this never raises

    def cleanup_run(self) -> None:
        """Delete everything under this run's prefix (call once, after every replica finished)."""
        self.wait_cleanup()
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.prefix, recursive=True)

    def rounds_present(self) -> list[int]:
        """Round numbers currently stored for this run (after the deletions in the background)."""
        self.wait_cleanup()
        return self._rounds_stored()
