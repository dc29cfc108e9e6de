"""The replay cache: one JSON file per answer, written atomically (a ``kill -9`` leaves a whole entry or none),
so a rerun never pays for an answer again (:mod:`composer_core.traces.replay` derives the keys)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["ReplayCache"]

log = logging.getLogger(__name__)


class ReplayCache:
    """On-disk cache: one JSON file per key under ``root/<teacher dir>/<key[:2]>/<key>.json``.

    Writes go to ``.tmp-<pid>-*`` then ``os.replace``: a killed process leaves a complete entry or none,
    plus maybe its temporary file, which the next :class:`ReplayCache` on the root removes.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.orphans_removed = self._remove_orphans()

    def _remove_orphans(self) -> int:
        """Delete temporary files whose writer (the pid in their name) is gone."""
        removed = 0
        for tmp in self.root.rglob(".tmp-*"):
            m = re.match(r"\.tmp-(\d+)-", tmp.name)
            if m is not None and not _pid_alive(int(m.group(1))):
                tmp.unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("replay cache %s: removed %d temporary files of an interrupted run", self.root, removed)
        return removed

    @staticmethod
    def teacher_dir(teacher: str) -> str:
        """A directory name for ``teacher`` that stays inside the cache (no ``/``, ``..``, leading dot)."""
        if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}", teacher):
            return teacher
        safe = re.sub(r"[^A-Za-z0-9_-]", "_", teacher)[:64]
        return f"{safe}-{hashlib.sha256(teacher.encode()).hexdigest()[:12]}"

    def _path(self, teacher: str, key: str) -> Path:
        p = self.root / self.teacher_dir(teacher) / key[:2] / f"{key}.json"
        if not p.resolve().is_relative_to(self.root.resolve()):
            raise ValueError(f"cache path {p} leaves the cache directory {self.root}")
        return p

    def get(self, teacher: str, key: str) -> dict[str, Any] | None:
        p = self._path(teacher, key)
        try:
            entry = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"corrupt cache entry {p}: {e}; delete it to re-request") from e
        if not isinstance(entry, dict) or entry.get("key") != key:
            raise ValueError(f"corrupt cache entry {p}: key mismatch; delete it to re-request")
        return entry

    def put(self, teacher: str, key: str, entry: Mapping[str, Any]) -> None:
        p = self._path(teacher, key)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".tmp-{os.getpid()}-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({**entry, "key": key}, f, ensure_ascii=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
