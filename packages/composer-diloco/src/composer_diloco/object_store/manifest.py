"""The round's single source of truth, the create-only ``manifest.json``; the progress markers
``progress/rank-<r>.json`` and withdrawal records (the rules: the README's "Serverless mode", items 1, 3, 4).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .backend import Backend
from .codec import _DIGEST, Decoded, Payload
from .errors import (
    CorruptObjectError,
    ObjectStoreError,
    RoundConflictError,
    RoundExpiredError,
    RoundWithdrawnError,
)

logger = logging.getLogger("composer_diloco.object_store")


@dataclass
class Manifest:
    ranks: list[int]
    tags: dict[int, bytes]
    fingerprint: str  # SHA-256 of the manifest's bytes, recorded in progress markers


class Manifests(Backend):
    """Manifests and progress markers."""

    def _read_manifest(self, round_id: int) -> Manifest | None:
        key = self.manifest_key(round_id)
        raw = self._read(key)
        return None if raw is None else self._parse_manifest(bytes(raw), key, round_id)

    def _parse_manifest(self, raw: bytes, key: str, round_id: int) -> Manifest:
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
        return Manifest(list(ranks), tags, hashlib.sha256(raw).hexdigest())

    def _propose(self, round_id: int, decoded: Mapping[int, Decoded]) -> Manifest:
        """Create the manifest of ``decoded``'s ranks; the stored one if another proposal won."""
        proposal = {
            "run_id": self.run_id,
            "round": round_id,
            "world_size": self.world_size,
            "ranks": sorted(decoded),
            "tags": {str(r): d.tag.hex() for r, d in sorted(decoded.items())},
            "proposer": self.rank,
        }
        data, key = self._dump_json(proposal), self.manifest_key(round_id)
        if self.put_if_absent(key, data):
            self._proposed = round_id
            return self._parse_manifest(data, key, round_id)
        found = self._read_manifest(round_id)
        if found is None:
            raise ObjectStoreError(f"round {round_id}: manifest {key} vanished right after creation.")
        return found

    def _read_committed(
        self, round_id: int, keys: Mapping[int, str], tags: Mapping[int, bytes], slot: str, **expect: Any
    ) -> dict[int, Decoded]:
        """The object at ``keys[r]`` of each rank ``r``, validated and carrying the tag ``tags[r]`` that the
        round committed (in its manifest, or in a committed index); :class:`RoundExpiredError` if one is gone."""
        out = {}
        for (r, key), raw in zip(
            keys.items(), self._read_many(list(keys.values()), [f"{slot}-{r}" for r in keys])
        ):
            if raw is None:
                raise self._expired(round_id, f"its manifest lists rank {r}", f"{key} is gone")
            out[r] = self.decode(raw, round_id=round_id, rank=r, key=key, expect=expect)
            if out[r].tag != tags[r]:
                raise CorruptObjectError(
                    f"object {key} is not the one committed in round {round_id}'s manifest or index (its tag "
                    "differs): it was replaced after publication. Objects are create-only; something else "
                    "writes to this run's prefix."
                )
        return out

    def _read_marker(self, rank: int) -> dict[int, str] | None:
        """Replica ``rank``'s progress marker: ``{round: manifest fingerprint}`` (None if absent)."""
        return self._parse_marker(rank, self._read(self.marker_key(rank)))

    def _parse_marker(self, rank: int, raw: Payload | None) -> dict[int, str] | None:
        if raw is None:
            return None
        key = self.marker_key(rank)
        obj = self._load_json(bytes(raw), key)
        try:
            if obj["run_id"] != self.run_id or obj["rank"] != rank:
                raise ValueError(f"run_id/rank {obj['run_id']!r}/{obj['rank']!r}")
            return {int(k): str(v) for k, v in obj["accepted"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptObjectError(f"progress marker {key} is not a marker of this run: {exc}") from exc

    def _read_markers(self, skip: int | None = None) -> dict[int, dict[int, str]]:
        own = self._marker  # only this replica writes it: no GET once known
        ranks = [r for r in range(self.world_size) if r != skip and (r != self.rank or own is None)]
        raws = self._read_many([self.marker_key(r) for r in ranks], [None] * len(ranks))
        markers = {r: self._parse_marker(r, raw) for r, raw in zip(ranks, raws)}
        if own is not None and skip != self.rank:
            markers[self.rank] = dict(own)
        return {r: m for r, m in sorted(markers.items()) if m is not None}

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

    def _committed(self, round_id: int) -> Manifest | None:
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
            gone = self._withdrawals(round_id, self._list(self.round_dir(round_id)), range(self.world_size))
            raise (
                self._withdrawn_error(round_id, gone)
                if gone
                else self._expired(round_id, evidence, "its manifest is gone")
            )
        return manifest

    def _withdraw(self, round_id: int, reason: str) -> None:
        """Remember that this replica refused its own payload for ``round_id``, and tell its peers with a
        create-only record (best effort: the caller gets the refusal either way)."""
        self._withdrawn = (round_id, reason)
        record = {"run_id": self.run_id, "round": round_id, "rank": self.rank, "reason": reason}
        try:
            self.put_if_absent(self.withdrawal_key(round_id, self.rank), self._dump_json(record))
        except Exception as exc:  # its peers then wait for it as for a straggler
            logger.warning(
                "could not record rank %d's withdrawal from round %d: %s", self.rank, round_id, exc
            )

    def _withdrawals(self, round_id: int, names: set[str], ranks: Iterable[int]) -> dict[int, str]:
        """Why each replica of ``ranks`` withdrew from ``round_id`` (``names``: the round folder's listing)."""
        out: dict[int, str] = {}
        for r in ranks:
            key = self.withdrawal_key(round_id, r)
            raw = self._read(key) if key.rsplit("/", 1)[-1] in names else None
            if raw is None:
                continue
            record = self._load_json(bytes(raw), key)
            if (record.get("run_id"), record.get("round"), record.get("rank")) != (self.run_id, round_id, r):
                raise CorruptObjectError(
                    f"{key} is not rank {r}'s withdrawal from round {round_id} of this run."
                )
            out[r] = str(record.get("reason"))
        return out

    def _withdrawn_error(self, round_id: int, withdrawn: Mapping[int, str]) -> RoundWithdrawnError:
        who = "; ".join(f"rank {r}: {why}" for r, why in sorted(withdrawn.items()))
        return RoundWithdrawnError(
            f"round {round_id} of run {self.run_id!r} was never committed: ranks {sorted(withdrawn)} refused "
            f"their own payloads and withdrew ({who}); rank {self.rank} applied nothing. Fix the cause there, "
            "then restart every replica from one checkpoint under a new run_id (with on_timeout='proceed' the "
            "others go on without a withdrawn replica)."
        )

    def _check_not_withdrawn(self, round_id: int) -> None:
        """A replica that withdrew from round w missed its average: it may not join a later round."""
        if self._withdrawn is None or round_id <= self._withdrawn[0]:
            return
        w, why = self._withdrawn
        raise RoundWithdrawnError(
            f"rank {self.rank} refused its own payload for round {w} ({why}) and cannot join round {round_id}: "
            f"it did not apply round {w}'s average, so its weights are no longer the other replicas'. Restart "
            "it from a checkpoint of the run's current round (every replica from one checkpoint if the others "
            "stopped too)."
        )

    def _accept(self, round_id: int, manifest: Manifest) -> None:
        """Record that this replica applies ``manifest`` for ``round_id`` (marker first), then check that no
        replica accepted another one; the record is taken back if the run has left the round."""
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

    def _check_markers(self, round_id: int, manifest: Manifest) -> None:
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

    def _rounds_stored(self) -> list[int]:
        """:meth:`_rounds_listed`, less a local round folder that is empty."""
        rounds = self._rounds_listed()
        return [r for r in rounds if self._list(self.round_dir(r))] if self._local else rounds
