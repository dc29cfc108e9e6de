"""ObjectStoreAllReduce: an all-reduce through any fsspec filesystem (see :mod:`.protocol`)."""

from .errors import (
    PHASES,
    AuthenticationError,
    CorruptObjectError,
    NonFiniteObjectError,
    NonFiniteResultError,
    ObjectStoreError,
    RoundConflictError,
    RoundExpiredError,
    RoundStats,
    RoundWithdrawnError,
    StragglerTimeoutError,
)
from .protocol import ObjectStoreAllReduce

__all__ = [
    "PHASES",
    "AuthenticationError",
    "CorruptObjectError",
    "NonFiniteObjectError",
    "NonFiniteResultError",
    "ObjectStoreAllReduce",
    "ObjectStoreError",
    "RoundConflictError",
    "RoundExpiredError",
    "RoundStats",
    "RoundWithdrawnError",
    "StragglerTimeoutError",
]
