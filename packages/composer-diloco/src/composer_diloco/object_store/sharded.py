"""``exchange="sharded"``: a reduce-scatter + all-gather through the store, under the full exchange's
manifest, markers, adoption and straggler rules (its three steps: the README's "Two exchanges, one protocol").
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Mapping, Sequence

import torch

from .codec import Decoded, Encoded, wire_form
from .errors import (
    CorruptObjectError,
    NonFiniteObjectError,
    NonFiniteResultError,
    ObjectStoreError,
    safe_part,
)
from .manifest import Manifest, Manifests
from .reduce import overflow_message, piece, sum_into

logger = logging.getLogger("composer_diloco.object_store")


class Sharded(Manifests):
    """The sharded exchange's objects and its reduce-scatter."""

    def shard_key(self, round_id: int, rank: int, shard: int, nonce: str) -> str:
        return self.round_dir(round_id, f"shard-{shard:05d}-rank-{rank:05d}-{safe_part('nonce', nonce)}.bin")

    def reduced_key(self, round_id: int, shard: int) -> str:
        return self.round_dir(round_id, f"reduced-{shard:05d}.bin")

    def _encode_sharded(
        self, round_id: int, tensors: Sequence[torch.Tensor], quantize: bool
    ) -> tuple[Encoded, Decoded]:
        """Write this replica's k shard objects under a fresh nonce, then return the *index* object listing
        their tags (creating it publishes the contribution)."""
        forms = [wire_form(t, i, self.rank, round_id, quantize) for i, t in enumerate(tensors)]
        k, nonce = self.world_size, uuid.uuid4().hex[:16]
        shards: dict[str, Encoded] = {}
        tags = {"exchange": "sharded", "quantized": quantize}
        for s in range(k):
            layout = [{**entry, "shape": [piece(wire, s, k).numel()]} for wire, entry, _ in forms]
            meta = self._meta(round_id, self.rank, **tags, kind="shard", shard=s, layout=layout)
            shards[self.shard_key(round_id, self.rank, s, nonce)] = self._pack(
                meta, [piece(wire, s, k) for wire, _, _ in forms], check_finite=not quantize
            )
        self._put_many(shards)
        meta = self._meta(
            round_id,
            self.rank,
            **tags,
            kind="index",
            layout=[],
            tensors=[entry for _, entry, _ in forms],
            shards=k,
            nonce=nonce,
            shard_tags=[enc.tag.hex() for enc in shards.values()],
        )
        index = self._pack(meta, [])
        return index, Decoded(meta, [own for *_, own in forms], index.size, index.tag)

    def _put_many(self, objects: Mapping[str, Encoded]) -> None:
        """Write objects under fresh keys (at once on object stores)."""
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
        manifest: Manifest,
        indexes: Mapping[int, Decoded],
        local: Decoded | None,
        op: str,
    ) -> list[torch.Tensor]:
        """Reduce this replica's shards, then collect the others (reducing one whose reducer is silent for
        ``timeout_s``). Every replica applies the *stored* reduced shard (create-only, first writer wins)."""
        ranks = manifest.ranks
        k, counts = self.world_size, {int(indexes[r].meta.get("shards", -1)) for r in ranks}
        if counts != {k}:
            raise CorruptObjectError(
                f"round {round_id}: the committed indexes split the tensors into {sorted(counts)} shards, "
                f"expected world_size={k}: every replica must run with the same world_size."
            )
        sizes = [math.prod(e["shape"]) for e in indexes[ranks[0]].meta["tensors"]]
        if [a.numel() for a in self._acc] != sizes:
            self._acc = [torch.empty(n, dtype=torch.float32) for n in sizes]
        mine = [s for s in range(k) if ranks[s % len(ranks)] == self.rank]
        deadline = time.monotonic() + self.timeout_s
        for s in mine + [s for s in range(k) if s not in mine]:
            reduced = None if s in mine else self._await_reduced(round_id, manifest, s, op, deadline)
            if reduced is None:
                reduced = self._reduce_shard(round_id, manifest, indexes, s, local, op)
            self._place(round_id, s, k, reduced)
        return self._acc

    def _place(self, round_id: int, s: int, k: int, reduced: Sequence[torch.Tensor]) -> None:
        for acc, got in zip(self._acc, reduced):
            target = piece(acc, s, k)
            if got.data_ptr() == target.data_ptr():  # reduced in place
                continue
            if got.numel() != target.numel():
                raise CorruptObjectError(
                    f"round {round_id}: reduced shard {s} holds {got.numel()} values where "
                    f"{target.numel()} belong: it does not match the committed layout."
                )
            target.copy_(got)

    def _reduce_shard(
        self,
        round_id: int,
        manifest: Manifest,
        indexes: Mapping[int, Decoded],
        s: int,
        local: Decoded | None,
        op: str,
    ) -> list[torch.Tensor]:
        """Σ over the participants (rank order) of their shard ``s``, ``/ n`` for avg, created as
        ``reduced-<s>.bin``; the stored one if another replica was first."""
        k = self.world_size
        own = [] if local is None else [piece(t, s, k) for t in local.tensors]
        read = self._read_shards(
            round_id, indexes, [r for r in manifest.ranks if r != self.rank or local is None], s
        )
        inputs = [read.get(r, own) for r in manifest.ranks]
        sums = [piece(acc, s, k) for acc in self._acc]  # reduced straight into the accumulators
        finite = sum_into(sums, inputs, op)
        layout = [{"shape": [t.numel()], "dtype": "float32", "wire": "float32", "scale": None} for t in sums]
        meta = self._meta(
            round_id, -1, exchange="sharded", quantized=False, kind="reduced", shard=s, layout=layout
        )
        # published as it is: a sum beyond float32 (op="sum") is refused by every replica
        reduced = self._pack({**meta, "manifest": manifest.fingerprint, "op": op}, sums)
        if self.put_if_absent(self.reduced_key(round_id, s), reduced):
            if not all(finite):
                raise NonFiniteResultError(overflow_message(round_id, f"reduced shard {s}", op))
            return sums
        stored = self._load_reduced(round_id, manifest, s, op)
        if stored is None:
            raise ObjectStoreError(f"round {round_id}: reduced shard {s} exists but could not be read; retry")
        return stored

    def _read_shards(
        self, round_id: int, indexes: Mapping[int, Decoded], ranks: Sequence[int], s: int
    ) -> dict[int, list[torch.Tensor]]:
        """Shard ``s`` of each of ``ranks``, checked against its index."""
        keys = {r: self.shard_key(round_id, r, s, str(indexes[r].meta["nonce"])) for r in ranks}
        tags = {r: bytes.fromhex(indexes[r].meta["shard_tags"][s]) for r in ranks}
        read = self._read_committed(round_id, keys, tags, "shard", kind="shard", shard=s)
        return {r: d.tensors for r, d in read.items()}

    def _load_reduced(self, round_id: int, manifest: Manifest, s: int, op: str) -> list[torch.Tensor] | None:
        key = self.reduced_key(round_id, s)
        raw = self._read(key, slot="reduced")
        if raw is None:
            return None
        expect = {"kind": "reduced", "shard": s, "manifest": manifest.fingerprint, "op": op}
        try:
            return self.decode(raw, round_id=round_id, rank=-1, key=key, expect=expect).tensors
        except NonFiniteObjectError as exc:  # its inputs were checked finite: their sum is beyond float32
            raise NonFiniteResultError(
                f"{overflow_message(round_id, f'reduced shard {s}', op)} ({key})"
            ) from exc

    def _await_reduced(
        self, round_id: int, manifest: Manifest, s: int, op: str, deadline: float
    ) -> list[torch.Tensor] | None:
        """The stored reduced shard ``s``; None if its reducer wrote none by ``deadline``."""
        delay = self._first_poll_s
        while True:
            found = self._load_reduced(round_id, manifest, s, op)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                owner = manifest.ranks[s % len(manifest.ranks)]
                msg = "round %d: rank %d wrote no reduced shard %d within timeout_s=%s; rank %d reduces it"
                logger.warning(msg, round_id, owner, s, self.timeout_s, self.rank)
                return None
            self._pause(min(delay, self.poll_interval_s, max(0.0, deadline - time.monotonic())))
            delay *= 2
