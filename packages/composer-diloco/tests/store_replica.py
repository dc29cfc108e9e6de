"""A replica program for the store fault tests: each call runs in its own process
(``composer_diloco.executors.run_spec``, with this folder on ``PYTHONPATH``).

It all-reduces one constant tensor per round through :class:`ObjectStoreAllReduce` and returns
what it ended with, or the name and text of the :class:`ObjectStoreError` that stopped it.
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Any

import torch
from composer_diloco import ObjectStoreAllReduce, ObjectStoreError
from composer_diloco.object_store import backend


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
    go_on_after_refusal: bool = False,
) -> dict[str, Any]:
    """``rounds``: ``[[round_id, value], ...]``. ``gate``: wait for this file before round one
    (after printing ``ready``), so that replicas started one after the other begin together.
    ``go_on_after_refusal``: when the store refuses this replica's own payload (NaN/inf), note it under
    ``refused`` and go on with the next round, as a training loop that catches the error would."""
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
        store.s3_part_bytes = multipart_chunksize
    print(f"ready rank={rank}", flush=True)
    if gate is not None:
        deadline = time.monotonic() + 300
        while not os.path.exists(gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {gate} never opened")
            time.sleep(0.02)
    results: list[dict[str, Any]] = []
    refused: dict[str, str] = {}
    for round_id, value in rounds:
        tensor = torch.full((numel,), float(value))
        try:
            stats = store.allreduce(int(round_id), [tensor])
        except ObjectStoreError as exc:
            print(f"round {int(round_id)} failed: {type(exc).__name__}: {exc}", flush=True)
            return {
                "results": results,
                "error": type(exc).__name__,
                "message": str(exc),
                "refused": refused,
                "unchanged": bool((tensor == float(value)).all()),  # nothing applied by the failed round
            }
        except ValueError as exc:
            if not go_on_after_refusal or "refusing to publish" not in str(exc):
                raise
            refused[str(int(round_id))] = str(exc)
            print(f"round {int(round_id)} refused, going on: {exc}", flush=True)
            continue
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
    return {"results": results, "error": None, "message": "", "refused": refused}


class _CountingFile:
    """A file object that adds every byte read to ``counter[0]``."""

    def __init__(self, f: Any, counter: list[int]) -> None:
        self._f, self._counter = f, counter

    def read(self, *args: Any) -> bytes:
        data = self._f.read(*args)
        self._counter[0] += len(data)
        return data  # type: ignore[no-any-return]

    def readinto(self, buf: Any) -> int:
        n = self._f.readinto(buf)
        self._counter[0] += n or 0
        return n  # type: ignore[no-any-return]

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def count_reads(fs: Any) -> list[int]:
    """Instrument an fsspec filesystem: every byte read through ``open``/``cat_file``/``cat`` is
    counted (independently of the store's own ``bytes_read``). Returns the counter."""
    counter = [0]
    open_, cat_file, cat = fs.open, fs.cat_file, fs.cat

    def counted_open(path: str, mode: str = "rb", **kw: Any) -> Any:
        f = open_(path, mode, **kw)
        return _CountingFile(f, counter) if "r" in mode else f

    def counted_cat_file(path: str, *args: Any, **kw: Any) -> Any:
        data = cat_file(path, *args, **kw)
        counter[0] += len(data)
        return data

    def counted_cat(path: Any, *args: Any, **kw: Any) -> Any:
        out = cat(path, *args, **kw)
        counter[0] += (
            sum(len(v) for v in out.values() if isinstance(v, bytes)) if isinstance(out, dict) else len(out)
        )
        return out

    fs.open, fs.cat_file, fs.cat = counted_open, counted_cat_file, counted_cat
    backend.mmap = _CountingMmap(counter)  # type: ignore[attr-defined]  # local objects are mapped, not read

    def counted_builtin_open(path: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        f = open(path, mode, *args, **kw)  # noqa: SIM115  # the caller closes it
        return _CountingFile(f, counter) if "r" in mode else f

    backend.open = counted_builtin_open  # type: ignore[attr-defined]  # local manifests and markers
    return counter


class _CountingMmap:
    """Stands in for the ``mmap`` module inside the store: every mapped byte counts as read (the
    checksums and the sum touch all of them)."""

    def __init__(self, counter: list[int]) -> None:
        self._counter = counter

    def mmap(self, *args: Any, **kw: Any) -> mmap.mmap:
        pages = mmap.mmap(*args, **kw)
        self._counter[0] += len(pages)
        return pages

    def __getattr__(self, name: str) -> Any:
        return getattr(mmap, name)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS and return that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def random_rounds(
    *,
    url: str,
    run_id: str,
    rank: int,
    world_size: int,
    rounds: int,
    numel: int,
    exchange: str,
    storage_options: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
    on_timeout: str = "fail",
    gate: str | None = None,
    die_before_reduce: bool = False,
) -> dict[str, Any]:
    """All-reduce ``torch.randn(numel)`` seeded by (round, rank) for ``rounds`` rounds; return the
    results, the bytes read and the peak RSS above its start per round (through an instrumented filesystem /
    VmHWM), the peak RSS growth over all rounds, and what stays resident once ``malloc_trim`` gave back the free
    chunks the allocator kept (``live_after``).
    ``die_before_reduce``: SIGKILL this process when it starts reducing its first shard."""
    import ctypes
    import signal

    torch.set_num_threads(1)  # one thread per replica process (several share the machine)
    store = ObjectStoreAllReduce(
        url,
        run_id,
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        on_timeout=on_timeout,  # type: ignore[arg-type]
        storage_options=storage_options,
        exchange=exchange,  # type: ignore[arg-type]
    )
    counter = count_reads(store.fs)
    if die_before_reduce:
        store._reduce_shard = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    tensors = [
        torch.randn(numel, generator=torch.Generator().manual_seed(1000 * r + rank)) for r in range(rounds)
    ]
    store.rounds_present()  # the store's client is set up (botocore loads its models) before the baseline
    print(f"ready rank={rank}", flush=True)
    if gate is not None:
        deadline = time.monotonic() + 300
        while not os.path.exists(gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {gate} never opened")
            time.sleep(0.02)
    rss0 = _status("VmRSS")
    out: list[dict[str, Any]] = []
    peak = 0  # the highest RSS over all rounds (the max of each round's own peak)
    for r, t in enumerate(tensors):
        before = counter[0]
        start = _reset_peak_rss()  # the peak read after the round is then that round's own
        stats = store.allreduce(r, [t])
        hwm = _status("VmHWM")
        peak = max(peak, hwm)
        out.append(
            {
                "value": t,
                "read": counter[0] - before,
                "participants": stats.participants,
                "seconds": stats.seconds,
                "store_read": stats.bytes_read,
                "peak_growth": hwm - start,  # this round's own peak above its start
            }
        )
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the allocator gives back the free chunks it kept
    live = _status("VmRSS") - rss0  # what the rounds left that something still holds
    return {"rounds": out, "payload": numel * 4, "peak_rss_growth": peak - rss0, "live_after": live}
