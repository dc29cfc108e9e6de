"""composer-diloco: torchft's DiLoCo, fault tolerant (Lighthouse + Managers) or serverless
(an all-reduce through an object store), with local-process and Ray executors."""

from importlib.metadata import version as _version

from .diloco import DiLoCoConfig, build_diloco, make_outer_optimizers, split_fragments
from .executors import (
    LocalProcessExecutor,
    RayExecutor,
    ReplicaFailedError,
    ReplicaResult,
    ServerlessExecutor,
)
from .object_store import (
    AuthenticationError,
    CorruptObjectError,
    NonFiniteObjectError,
    NonFiniteResultError,
    ObjectStoreAllReduce,
    ObjectStoreError,
    RoundConflictError,
    RoundExpiredError,
    RoundWithdrawnError,
    StragglerTimeoutError,
)
from .object_store.codec import dequantize_fp8, quantize_fp8
from .serverless import run_serverless
from .serverless_manager import ObjectStoreManager
from .training import TrainStats, train_diloco

__version__ = _version("composer-diloco")

__all__ = [
    "AuthenticationError",
    "CorruptObjectError",
    "DiLoCoConfig",
    "LocalProcessExecutor",
    "NonFiniteObjectError",
    "NonFiniteResultError",
    "ObjectStoreAllReduce",
    "ObjectStoreError",
    "ObjectStoreManager",
    "RayExecutor",
    "ReplicaFailedError",
    "ReplicaResult",
    "RoundConflictError",
    "RoundExpiredError",
    "RoundWithdrawnError",
    "ServerlessExecutor",
    "StragglerTimeoutError",
    "TrainStats",
    "__version__",
    "build_diloco",
    "dequantize_fp8",
    "make_outer_optimizers",
    "quantize_fp8",
    "run_serverless",
    "split_fragments",
    "train_diloco",
]


def __getattr__(name: str) -> object:
    # fault-tolerant helpers and the TRL callback load their heavier imports on first use
    if name in {"Lighthouse", "FaultTolerantLauncher", "launch_fault_tolerant", "make_manager"}:
        from . import fault_tolerant

        return getattr(fault_tolerant, name)
    if name == "DiLoCoCallback":
        from .trl_callback import DiLoCoCallback

        return DiLoCoCallback
    raise AttributeError(f"module 'composer_diloco' has no attribute {name!r}")
