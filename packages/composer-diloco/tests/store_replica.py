"""A replica program for the store fault tests: each call runs in its own process
(``python -m composer_diloco._worker``, with this folder on ``PYTHONPATH``).

It all-reduces one constant tensor per round through :class:`ObjectStoreAllReduce` and returns
what it ended with, or the name and text of the :class:`ObjectStoreError` that stopped it.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import torch
from composer_diloco import ObjectStoreAllReduce, ObjectStoreError


def exchange(
    *,
    url: str,
    run_id: str,
    rank: int,
    world_size: int,
    rounds: list[list[float]],
    storage_options: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
    on_timeout: str = "fail",
    keep_rounds: int = 2,
    numel: int = 4,
    gate: str | None = None,
    multipart_chunksize: int | None = None,
) -> dict[str, Any]:
    """``rounds``: ``[[round_id, value], ...]``. ``gate``: wait for this file before round one
    (after printing ``ready``), so that replicas started one after the other begin together."""
    store = ObjectStoreAllReduce(
        url,
        run_id,
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        on_timeout=on_timeout,  # type: ignore[arg-type]
        keep_rounds=keep_rounds,
        storage_options=storage_options,
    )
    if multipart_chunksize:  # S3 multipart uploads for objects over 2 chunks (s3fs's rule)
        store.fs.pipe_file = functools.partial(store.fs.pipe_file, chunksize=multipart_chunksize)  # type: ignore[method-assign]
    print(f"ready rank={rank}", flush=True)
    if gate is not None:
        deadline = time.monotonic() + 300
        while not os.path.exists(gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {gate} never opened")
            time.sleep(0.02)
    results: list[dict[str, Any]] = []
    for round_id, value in rounds:
        tensor = torch.full((numel,), float(value))
        try:
            stats = store.allreduce(int(round_id), [tensor])
        except ObjectStoreError as exc:
            print(f"round {int(round_id)} failed: {type(exc).__name__}: {exc}", flush=True)
            return {"results": results, "error": type(exc).__name__, "message": str(exc)}
        results.append(
            {
                "round": int(round_id),
                "value": float(tensor[0]),
                "uniform": bool((tensor == tensor[0]).all()),
                "participants": list(stats.participants),
                "excluded": {str(k): v for k, v in stats.excluded.items()},
                "adopted": bool(getattr(stats, "adopted", False)),
            }
        )
        print(f"round {int(round_id)} done value={float(tensor[0])}", flush=True)
    return {"results": results, "error": None, "message": ""}
