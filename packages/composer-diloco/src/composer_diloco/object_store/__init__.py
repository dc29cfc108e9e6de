"""ObjectStoreAllReduce: an all-reduce through any fsspec filesystem (see :mod:`.protocol`).

Modules: :mod:`.protocol` (the round), :mod:`.manifest` (manifests and progress markers), :mod:`.codec`
(the object format, HMAC), :mod:`.backend` (create-only writes and reads over fsspec), :mod:`.sharded`
(the sharded exchange), :mod:`.reduce` (the arithmetic), :mod:`.errors`.
"""

from .backend import S3_PART_BYTES, S3_PARTS_IN_FLIGHT
from .codec import (
    FP8_MAX,
    HMAC_KEY_ENV,
    MAGIC,
    MAGIC_HMAC,
    MIN_HMAC_KEY_BYTES,
    Payload,
    dequantize_fp8,
    quantize_fp8,
)
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
    StragglerTimeoutError,
    safe_part,
)
from .protocol import ObjectStoreAllReduce

__all__ = [
    "FP8_MAX",
    "HMAC_KEY_ENV",
    "MAGIC",
    "MAGIC_HMAC",
    "MIN_HMAC_KEY_BYTES",
    "PHASES",
    "S3_PARTS_IN_FLIGHT",
    "S3_PART_BYTES",
    "AuthenticationError",
    "CorruptObjectError",
    "NonFiniteObjectError",
    "NonFiniteResultError",
    "ObjectStoreAllReduce",
    "ObjectStoreError",
    "Payload",
    "RoundConflictError",
    "RoundExpiredError",
    "RoundStats",
    "StragglerTimeoutError",
    "dequantize_fp8",
    "quantize_fp8",
    "safe_part",
]
