"""ObjectStoreAllReduce: an all-reduce through any fsspec filesystem, with no network path between replicas.

The invariant: **every replica that completes round r applies the same average, or fails with an error naming
why**; the round's committed manifest is its single source of truth. The steps of a round: the README's
"Serverless mode"; objects: :mod:`.codec`, writes: :mod:`.backend`, manifests and markers: :mod:`.manifest`,
the arithmetic: :mod:`.reduce`, ``exchange="sharded"``: :mod:`.sharded`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch

from .codec import Decoded, Encoded, Payload
from .errors import (
    CorruptObjectError,
    Laps,
    NonFiniteResultError,
    ObjectStoreError,
    RoundExpiredError,
    RoundStats,
    RoundWithdrawnError,
    StragglerTimeoutError,
)
from .manifest import Manifest
from .reduce import (
    REDUCE_PIECE,
    apply,
    bucketable,
    check_layouts,
    direct_targets,
    overflow_message,
    reduce_bucket,
    reduce_pieces,
    runs,
    sum_into,
)
from .sharded import Sharded

logger = logging.getLogger("composer_diloco.object_store")
_PROPOSAL_LOOKS = 4  # reads of rank min(ranks)'s manifest before the others propose too
_CLEANUPS_QUEUED = 2  # deletions that may wait behind the running one


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
        poll_interval_s: the longest delay between listings of the round folder.
        exchange: ``"full"`` (each replica reads (k−1)× the payload) or ``"sharded"`` (reduce-scatter
            + all-gather: about 2× the payload whatever k). Every replica of a run must use the same.
        storage_options: passed to ``fsspec.url_to_fs`` (e.g. ``key``/``secret``/``client_kwargs``).
        hmac_key_env: the environment variable holding the shared HMAC secret (≥ 16 bytes). When set,
            objects, manifests and markers are signed with HMAC-SHA256; others are refused
            (:class:`AuthenticationError`).
        require_hmac: raise at construction if ``hmac_key_env`` is not set.
    """

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
        self._check_not_withdrawn(round_id)
        laps = Laps()
        written0, read0 = self.bytes_written, self.bytes_read
        in_step, self._next_round, self._proposed = self._next_round == round_id, None, None
        problems: dict[int, ObjectStoreError] = {}
        manifest = None if in_step else self._committed(round_id)
        laps("commit")
        own: Decoded | None = None
        reused, adopted = False, manifest is not None
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
                msg = (
                    "round %d is already committed (ranks %s): rank %d adopts its average, not its new values"
                )
                logger.warning(msg, round_id, manifest.ranks, self.rank)
            self._apply_round(round_id, manifest, decoded, tensors, None if adopted else own, op, laps)
        except RoundExpiredError:
            if own is not None and not reused:
                self._discard(round_id)
            raise
        self._cleanup(round_id, manifest)
        self._next_round = round_id + 1
        if self._withdrawn is not None and self._withdrawn[0] == round_id:  # re-run: it published now
            self._withdrawn = None
        self.last = RoundStats(
            round=round_id,
            participants=list(manifest.ranks),
            excluded=self._excluded(round_id, manifest, problems),
            bytes_written=self.bytes_written - written0,
            bytes_read=self.bytes_read - read0,
            seconds=time.perf_counter() - laps.start,
            adopted=adopted,
            phases=laps.phases,
        )
        if self.last.excluded:
            logger.warning("round %d proceeded without ranks %s", round_id, self.last.excluded)
        return self.last

    def _excluded(
        self, round_id: int, manifest: Manifest, problems: Mapping[int, ObjectStoreError]
    ) -> dict[int, str]:
        """Why each rank is not in ``manifest``: what this replica saw, or the rank's withdrawal record."""
        out = {
            r: str(problems.get(r, "no object")) for r in range(self.world_size) if r not in manifest.ranks
        }
        unknown = [r for r in out if r not in problems]
        if unknown:  # another replica proposed the manifest: a withdrawal this one did not see is still named
            names = self._list(self.round_dir(round_id))
            out |= {r: f"withdrew: {why}" for r, why in self._withdrawals(round_id, names, unknown).items()}
        return out

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
        into ``tensors``: nothing changes before every check has passed."""
        inputs = self._gather(round_id, manifest, decoded)
        check_layouts(inputs, manifest.ranks, tensors, round_id)
        with torch.no_grad():
            if self.exchange == "sharded":
                xs: list[list[torch.Tensor]] = []  # every result is staged: the reduced shards
                staged = dict(enumerate(self._sharded_result(round_id, manifest, inputs, local, op)))
            else:
                xs = [inputs[r].tensors for r in manifest.ranks]
                staged = self._stage(round_id, tensors, xs, op)
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
        encode = self._encode_sharded if self.exchange == "sharded" else self._encode
        try:
            encoded = encode(round_id, tensors, quantize)
        except ValueError as exc:  # NaN/inf or a bad layout: refused before anything is published
            self._withdraw(round_id, str(exc))
            raise
        return self._publish(round_id, *encoded)

    def _stage(
        self,
        round_id: int,
        tensors: Sequence[torch.Tensor],
        inputs: Sequence[Sequence[torch.Tensor]],
        op: str,
    ) -> dict[int, torch.Tensor]:
        """The results of the targets not written piece by piece (:func:`direct_targets`; every target
        under ``op="sum"``), by index, in the reused accumulators; :class:`NonFiniteResultError` before
        any tensor changes."""
        direct = set() if op == "sum" else direct_targets(tensors)
        rest = [i for i in range(len(tensors)) if i not in direct]
        if not rest:
            return {}
        columns = [[x[i] for i in rest] for x in inputs]
        if [a.numel() for a in self._acc] != [t.numel() for t in columns[0]]:
            self._acc = [torch.empty(t.numel(), dtype=torch.float32) for t in columns[0]]
        sums, finite = self._acc, sum_into(self._acc, columns, op)
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
        """``tensors ← Σ_r inputs[r]`` (float32, rank order), ``/ n`` for avg: the ``staged`` results first,
        every other target through a cache-sized scratch (:func:`reduce_pieces`), small float32 ones
        several at a time (:func:`reduce_bucket`). The same bits either way."""
        for i, acc in staged.items():
            apply(tensors[i], acc, 1)
        rest = [i for i in range(len(tensors)) if i not in staged]
        if not rest:
            return
        divisor = len(inputs) if op == "avg" else 1
        if self._scratch is None:
            self._scratch = torch.empty(REDUCE_PIECE, dtype=torch.float32)
        small = [i for i in rest if bucketable(tensors[i], [x[i] for x in inputs])]
        for bucket in runs(small, [tensors[i].numel() for i in small], REDUCE_PIECE):
            columns = [[x[i] for i in bucket] for x in inputs]
            reduce_bucket([tensors[i] for i in bucket], columns, divisor, self._scratch)
        for i in sorted(set(rest) - set(small)):
            reduce_pieces(tensors[i], [x[i] for x in inputs], divisor, self._scratch)

    def _publish(self, round_id: int, data: Encoded, own: Decoded) -> tuple[Decoded, bool]:
        """Create this replica's object, or return the stored one (objects are immutable). True if reused."""
        key = self.object_key(round_id, self.rank)
        created = self.put_if_absent(key, data)
        if created:
            return own, False
        raw = self._read(key, slot=f"obj-{self.rank}")
        if raw is None:
            raise ObjectStoreError(f"round {round_id}: {key} exists but could not be read; retry the round.")
        stored = self.decode(raw, round_id=round_id, rank=self.rank, key=key)
        if stored.tag != own.tag:
            msg = "round %d: rank %d's object %s was published earlier with other values; it is immutable (other replicas may have read it), so this round uses the stored one"
            logger.warning(msg, round_id, self.rank, key)
        return stored, True

    def _gather(self, round_id: int, manifest: Manifest, decoded: dict[int, Decoded]) -> dict[int, Decoded]:
        """The committed objects: each participant's object with the tag the manifest lists."""
        out = {r: decoded[r] for r in manifest.ranks if r in decoded and decoded[r].tag == manifest.tags[r]}
        keys = {r: self.object_key(round_id, r) for r in manifest.ranks if r not in out}
        out |= self._read_committed(round_id, keys, manifest.tags, "obj")
        return {r: out[r] for r in manifest.ranks}

    def _await_manifest(
        self, round_id: int, decoded: dict[int, Decoded], problems: dict[int, ObjectStoreError]
    ) -> Manifest:
        """Collect the other ranks' objects until all are present or ``timeout_s`` passes, then propose the
        participant set. The first look reads the objects directly; each later one lists first, and adopts a
        manifest committed meanwhile or notices a run that has left this round."""
        deadline = time.monotonic() + self.timeout_s
        delay = self._first_poll_s
        names: set[str] | None = None  # None: the first look, which lists nothing
        while True:
            listed = [r for r in range(self.world_size) if names is None or f"rank-{r:05d}.bin" in names]
            self._take(round_id, [r for r in listed if r not in decoded], decoded, problems)
            timed_out = time.monotonic() >= deadline
            if len(decoded) == self.world_size or timed_out:
                if len(decoded) < self.world_size:
                    committed = self._committed(round_id)
                    if committed is not None:
                        return committed
                    self._check_timeout(round_id, decoded, problems)
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
            if self._note_withdrawals(round_id, names, decoded, problems):
                deadline = time.monotonic()  # nobody left to wait for: go on without them now
            if later:
                committed = self._committed(round_id)
                if committed is not None:
                    return committed

    def _note_withdrawals(
        self,
        round_id: int,
        names: set[str],
        decoded: Mapping[int, Decoded],
        problems: dict[int, ObjectStoreError],
    ) -> bool:
        """Raise :class:`RoundWithdrawnError` for ranks that withdrew from the round (``"fail"``), or note them
        in ``problems`` (``"proceed"``); True if every rank has delivered or withdrawn."""
        gone = self._withdrawals(round_id, names, [r for r in range(self.world_size) if r not in decoded])
        if gone and self.on_timeout == "fail":
            raise self._withdrawn_error(round_id, gone)
        problems.update({r: RoundWithdrawnError(f"withdrew: {why}") for r, why in gone.items()})
        return bool(gone) and len(decoded) + len(gone) == self.world_size

    def _await_proposal(self, round_id: int) -> Manifest | None:
        """On an object store rank ``min(ranks)`` proposes and the others read its manifest (a GET costs less
        than a losing create-only PUT) for ``_PROPOSAL_LOOKS`` looks before proposing too."""
        delay = self._first_poll_s
        for _ in range(_PROPOSAL_LOOKS - 1):
            found = self._read_manifest(round_id)
            if found is not None:
                return found
            time.sleep(delay)
            delay *= 2
        return self._read_manifest(round_id)

    def _take(
        self,
        round_id: int,
        ranks: Sequence[int],
        decoded: dict[int, Decoded],
        problems: dict[int, ObjectStoreError],
    ) -> None:
        """Read and validate the objects of ``ranks`` that exist now."""
        for r, key, raw in self._objects(round_id, ranks):
            if raw is None:
                continue
            try:
                decoded[r] = self.decode(raw, round_id=round_id, rank=r, key=key)
                problems.pop(r, None)
            except CorruptObjectError as exc:
                problems[r] = exc  # maybe still being written by a non-atomic writer: re-read

    def _objects(self, round_id: int, ranks: Sequence[int]) -> list[tuple[int, str, Payload | None]]:
        """(rank, key, bytes or None) of the objects of ``ranks``, read at once on an object store."""
        keys = [self.object_key(round_id, r) for r in ranks]
        return list(zip(ranks, keys, self._read_many(keys, [f"obj-{r}" for r in ranks])))

    def _scan(self, round_id: int) -> tuple[set[str], bool]:
        """The names in round ``round_id``'s folder, and whether a later round is stored."""
        if self._s3:
            keys = self._round_keys()
            here = f"{round_id:010d}"
            names = {name for r, name in keys if r == here}
            return names, any(int(r) > round_id for r, _ in keys if r.isdigit())
        return self._list(self.round_dir(round_id)), any(r > round_id for r in self._rounds_listed())

    def _discard(self, round_id: int) -> None:
        """Best effort: delete what this call wrote into ``round_id``, a round the run has left (its objects,
        the manifest it proposed, an emptied local folder)."""
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
        self, round_id: int, decoded: Mapping[int, Decoded], problems: Mapping[int, ObjectStoreError]
    ) -> None:
        missing = {r: str(problems.get(r, "no object")) for r in range(self.world_size) if r not in decoded}
        corrupt = {r: p for r, p in problems.items() if r in missing and isinstance(p, CorruptObjectError)}
        if self.on_timeout == "fail" and corrupt:
            kinds = {type(exc) for exc in corrupt.values()}
            cls = kinds.pop() if len(kinds) == 1 else CorruptObjectError
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
        """Delete rounds up to ``round_id - keep_rounds`` on one background worker; participant
        ``ranks[round_id % n]`` of the manifest does it."""
        old = round_id - self.keep_rounds
        if old < 0 or manifest.ranks[round_id % len(manifest.ranks)] != self.rank:
            return
        if self._cleaner is None:
            self._cleaner = ThreadPoolExecutor(1, thread_name_prefix="diloco-store-cleanup")
        self._cleanups = [f for f in self._cleanups if not f.done()]
        while len(self._cleanups) > _CLEANUPS_QUEUED:
            self._cleanups.pop(0).result()
        self._cleanups.append(self._cleaner.submit(self._remove_round, old))

    def _remove_round(self, old: int) -> None:
        try:
            self._remove_rounds(old)
        except Exception as exc:  # a failed cleanup leaves garbage, never a wrong average
            logger.warning("could not delete rounds up to %d of run %r: %s", old, self.run_id, exc)

    def wait_cleanup(self) -> None:
        """Wait until the deletions of old rounds running in the background have finished."""
        pending, self._cleanups = self._cleanups, []
        for f in pending:
            f.result()

    def cleanup_run(self) -> None:
        """Delete everything under this run's prefix (call once, after every replica finished)."""
        self.wait_cleanup()
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.prefix, recursive=True)

    def rounds_present(self) -> list[int]:
        """Round numbers currently stored for this run (after the deletions in the background)."""
        self.wait_cleanup()
        return self._rounds_stored()
