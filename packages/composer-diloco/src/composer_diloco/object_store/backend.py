"""Storage primitives over fsspec: create-only and atomic writes, reads, listings, deletions (how each kind
of store makes a write create-only or atomic: the README's "Serverless mode", item 2).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import posixpath
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar

from .codec import Codec, Encoded, Payload
from .errors import ObjectStoreError

_T = TypeVar("_T")
_MAP_MIN = 2 << 20  # local objects this large are mapped, smaller ones read into a kept buffer
_MEMORY_LOCK = threading.Lock()


class Backend(Codec):
    """Reads and writes of one store (``file://`` paths go straight to the OS)."""

    def put_atomic(self, key: str, data: bytes) -> None:
        """Write ``data`` so that readers see all of it or nothing (the old value until then)."""
        if self._local:
            self._via_tmp(key, [data], os.replace)
        else:
            self.fs.pipe_file(key, data)
        self.bytes_written += len(data)

    def put_if_absent(self, key: str, data: bytes | Encoded) -> bool:
        """Create ``key`` only if it does not exist; True if we created it. Readers see all of ``data`` or
        nothing."""
        enc = data if isinstance(data, Encoded) else Encoded(bytes(data), [], b"")
        created = self._create(key, enc)
        self.bytes_written += enc.size if created else 0
        return created

    def _create(self, key: str, enc: Encoded) -> bool:
        if self._local:
            try:
                self._via_tmp(key, [memoryview(enc.head), *enc.chunks], os.link)
                return True
            except FileExistsError:
                return False
        data = enc.tobytes()  # bytes, not a bytearray: aiohttp would copy a bytearray three more times
        if self._memory:
            with _MEMORY_LOCK:
                if self.fs.exists(key):
                    return False
                self.fs.pipe_file(key, data)
                return True
        options = (
            {"chunksize": self.s3_part_bytes, "max_concurrency": self.s3_parts_in_flight} if self._s3 else {}
        )
        try:
            self.fs.pipe_file(key, data, mode="create", **options)  # S3: If-None-Match: *
            return True
        except FileExistsError:
            return False
        except (TypeError, ValueError, NotImplementedError) as exc:
            raise ObjectStoreError(
                f"{type(self.fs).__name__} offers no conditional put (pipe_file(mode='create')); "
                "composer-diloco needs one to agree on a round's participants. Use file://, memory:// "
                "or s3:// (s3fs >= 2024.12), or an fsspec backend with create-only writes."
            ) from exc
        finally:
            if self._s3:
                self.fs.invalidate_cache(key)

    def _via_tmp(
        self, key: str, pieces: Sequence[bytes | memoryview], op: Callable[[str, str], None]
    ) -> None:
        """Write ``pieces`` to a temporary file in the run's ``tmp/`` folder, then ``op(tmp, key)`` (link or
        replace); no temporary file is left behind."""
        tmp = f"{self.key('tmp')}/.tmp-{uuid.uuid4().hex}"
        try:
            with _in_folder(lambda: open(tmp, "wb"), posixpath.dirname(tmp)) as f:
                for piece in pieces:
                    f.write(piece)
            _in_folder(lambda: op(tmp, key), posixpath.dirname(key))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _slot(self, slot: str, size: int) -> memoryview:
        buf = self._buffers.get(slot)
        if buf is None or len(buf) < size:
            buf = self._buffers[slot] = bytearray(size)
        return memoryview(buf)[:size]

    def _read(self, key: str, slot: str | None = None) -> Payload | None:
        return self._read_many([key], [slot])[0]

    def _read_many(self, keys: Sequence[str], slots: Sequence[str | None]) -> list[Payload | None]:
        """The objects' bytes, None for each absent one; on object stores one concurrent ``fs.cat``
        (``max_concurrency=1``: s3fs sends no HEAD first)."""
        if self._local or not keys:
            return [self._read_local(key, slot) for key, slot in zip(keys, slots)]
        for folder in {posixpath.dirname(key) for key in keys}:
            self.fs.invalidate_cache(folder)  # s3fs answers from a stale listing otherwise
        got = self.fs.cat(list(keys), on_error="return", **({"max_concurrency": 1} if self._s3 else {}))
        out: list[Payload | None] = []
        for data in (got[key] for key in keys):
            if isinstance(data, BaseException) and not isinstance(data, FileNotFoundError):
                raise data
            out.append(None if isinstance(data, FileNotFoundError) else bytes(data))
            self.bytes_read += len(out[-1] or b"")
        return out

    def _read_local(self, key: str, slot: str | None) -> memoryview | None:
        """A local object's bytes: mapped copy-on-write if large, with a ``slot`` and unsigned (objects are
        create-only); otherwise read into the slot's buffer. A signed object is always copied: an untrusted
        writer could change a mapped file between its check and its use."""
        try:
            f = open(key, "rb", buffering=0)  # noqa: SIM115  # closed below, also when mapped
        except FileNotFoundError:
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            if slot is not None and size >= _MAP_MIN and self._mac is None:
                self.bytes_read += size
                return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
            view, got = (memoryview(bytearray(size)) if slot is None else self._slot(slot, size)), 0
            while got < size:  # a file shorter than its size a moment ago reads short: its digest fails
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

    def _pause(self, seconds: float) -> None:
        time.sleep(seconds)

    def _round_keys(self) -> list[tuple[str, str]]:
        """(round folder, name) of every object under the run's ``rounds/``."""
        prefix = self.key("rounds")
        if self._local or self._memory:
            return [(r, name) for r in self._list(prefix) for name in self._list(f"{prefix}/{r}")]
        self.fs.invalidate_cache(prefix)
        try:
            keys = self.fs.find(prefix)
        except FileNotFoundError:
            return []
        pairs = [str(k)[len(prefix) + 1 :].split("/") for k in keys]
        return [(p[0], p[1]) for p in pairs if len(p) == 2]

    def _rounds_listed(self) -> list[int]:
        """Round numbers in the store's listing now (may include one being deleted)."""
        return sorted(int(n) for n in self._list(self.key("rounds")) if n.isdigit())

    def _remove_rounds(self, old: int) -> None:
        """Delete every stored round up to ``old``."""
        if self._s3:
            keys = [
                f"{self.key('rounds')}/{r}/{n}"
                for r, n in self._round_keys()
                if r.isdigit() and int(r) <= old
            ]
            if keys:
                self.fs.rm(keys)
            return
        for r in self._rounds_listed():
            if r <= old:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(self.round_dir(r), recursive=True)


def _in_folder(op: Callable[[], _T], folder: str) -> _T:
    """``op()``, once more after making ``folder`` if it failed for want of it."""
    try:
        return op()
    except FileNotFoundError:
        os.makedirs(folder, exist_ok=True)
        return op()
