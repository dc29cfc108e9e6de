"""The object store's errors, key validation and round statistics."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
PHASES = ("publish", "commit", "reduce", "accept", "apply")  # RoundStats.phases, in a round's order


class ObjectStoreError(RuntimeError):
    """An exchange through the object store could not complete."""


class StragglerTimeoutError(ObjectStoreError, TimeoutError):
    """Some replicas did not deliver a valid object for a round within ``timeout_s``."""


class CorruptObjectError(ObjectStoreError, ValueError):
    """An object in the store is truncated, corrupt, or belongs to another run/round/rank."""


class NonFiniteObjectError(CorruptObjectError):
    """An object passes its checksum but holds NaN/inf values (never averaged)."""


class NonFiniteResultError(ObjectStoreError, ValueError):
    """Every contribution is finite but their sum is beyond float32: no replica applies it."""


class AuthenticationError(CorruptObjectError):
    """An object, manifest or marker is unauthenticated or fails its HMAC-SHA256 check."""


class RoundExpiredError(ObjectStoreError):
    """Round r was committed but its result is gone from the store: restart from a checkpoint."""


class RoundWithdrawnError(ObjectStoreError):
    """A replica refused its own payload for round r (NaN/inf): the round cannot complete with it, and it
    cannot join a later round (it missed round r's average)."""


class RoundConflictError(ObjectStoreError):
    """Replicas accepted different manifests for one round: they may no longer be identical."""


def safe_part(name: str, value: object) -> str:
    """Validate one key component (letters, digits, ``._-``, no leading dot, no ``/``): keys never
    leave the run's prefix."""
    if not isinstance(value, str) or not _PART.fullmatch(value) or value in {".", ".."}:
        raise ValueError(
            f"{name}={value!r} is not a safe object-store key component: use letters, digits, '.', '_' "
            "or '-', not starting with '.', with no '/' (keys may never escape the run prefix)."
        )
    return value


@dataclass
class RoundStats:
    """What the last round did. ``phases``: seconds per phase (:data:`PHASES`), back to back (each phase: the
    README's "Serverless mode")."""

    round: int = -1
    participants: list[int] = field(default_factory=list)
    excluded: dict[int, str] = field(default_factory=dict)
    bytes_written: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    adopted: bool = False  # this replica's new values were not its contribution
    phases: dict[str, float] = field(default_factory=dict)


class Laps:
    """A round's :data:`PHASES` timed back to back."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.phases = dict.fromkeys(PHASES, 0.0)

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] += now - self._last
        self._last = now
