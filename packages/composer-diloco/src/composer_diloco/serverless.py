"""Serverless launch: N replicas through an executor, rendezvous only through an object store."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .executors import ReplicaResult, ServerlessExecutor
from .object_store import ObjectStoreAllReduce
from .object_store.errors import safe_part


def run_serverless(
    executor: ServerlessExecutor,
    target: str,
    *,
    url: str,
    run_id: str,
    world_size: int,
    kwargs: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
    cleanup: bool = True,
) -> list[ReplicaResult]:
    """Run ``target`` on ``world_size`` replicas (kwargs + ``url``, ``run_id``, ``rank``, ``world_size``,
    ``storage_options``) on a store they share (not ``memory://``), then delete the run's objects if
    ``cleanup``."""
    safe_part("run_id", run_id)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    if url.startswith("memory://"):
        raise ValueError(
            "url='memory://…' is local to one process; executors run replicas in separate processes. Use file:// or s3://."
        )
    common = dict(kwargs or {})
    clash = {"url", "run_id", "rank", "world_size", "storage_options"} & set(common)
    if clash:
        raise ValueError(f"kwargs sets {sorted(clash)}; run_serverless provides them.")
    fixed = {
        "url": url,
        "run_id": run_id,
        "world_size": world_size,
        "storage_options": dict(storage_options or {}),
    }
    replica_kwargs = [{**common, **fixed, "rank": r} for r in range(world_size)]
    try:
        return executor.run(target, replica_kwargs, timeout_s=timeout_s)
    finally:
        if cleanup:
            ObjectStoreAllReduce(
                url, run_id, rank=0, world_size=world_size, storage_options=storage_options
            ).cleanup_run()
