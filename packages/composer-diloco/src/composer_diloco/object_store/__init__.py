"""ObjectStoreAllReduce: an all-reduce through any fsspec filesystem (see :mod:`.protocol`)."""

from .codec import MAGIC, dequantize_fp8, quantize_fp8
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
    safe_part,
)
from .protocol import ObjectStoreAllReduce

__all__ = [
    "MAGIC",
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
    "dequantize_fp8",
    "quantize_fp8",
    "safe_part",
]
