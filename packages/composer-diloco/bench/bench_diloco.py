"""composer-diloco benchmark (run by ``nox -s bench``).

1. Communication: bytes a replica exchanges per *inner* step with torchft's DiLoCo on the
   serverless ObjectStoreManager (measured: bytes written + read through the store, two replicas,
   fp32 and fp8-quantised), against what DDP would exchange for the same model every step
   (ring all-reduce of fp32 gradients: 2·(k−1)/k·P·4 bytes sent and as many received).
2. Throughput: an ObjectStoreAllReduce round (encode + checksum + atomic write + manifest +
   validated read + average) against a raw fsspec copy of the same bytes (each replica writes its blob
   and reads the other's), both run by 2 replica processes started together by a barrier (as in
   training, each replica has its own interpreter: no GIL shared with the other replica or with moto),
   over file:// and s3:// (moto's server on 127.0.0.1, in the bench's process), at 1, 16 and 64 MiB
   (``--small``: 1 and 16 MiB; ``--large`` or ``$COMPOSER_BENCH_LARGE=1`` adds 512 MiB). The two are interleaved rep by rep, the order
   alternating, each file:// rep after ``os.sync()`` and the stores' pending deletions (outside the clock);
   median and spread are reported (the machine is shared). Peak RSS growth per replica
   over 3 rounds (replica processes, VmHWM) against the payload, at every size but 1 MiB. One
   replica's publish alone (checksums, NaN/inf check and create-only write of its object) against a raw
   fsspec write of the same bytes, interleaved the same way: what writing an object costs over its bytes.
3. Scale in replicas: k = 2, 4, 8 real replica processes over file://, the full exchange (every
   replica reads every object) against the sharded one (reduce-scatter + all-gather), rounds
   interleaved: bytes read and round time per replica against k.

Torch runs one intra-op thread per replica (several replicas share the machine; a 2-thread pool
per replica on a loaded 2-core host costs ~10 ms per elementwise op in scheduling alone).
Prints tables and writes JSON (with the README table) and a PNG to $COMPOSER_BENCH_OUT.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import resource
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

# composer_testkit: composer-core's tests/support, never shipped (CONTRIBUTING.md, Test support)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "composer-core" / "tests" / "support"))

import torch
from composer_diloco import DiLoCoConfig, ObjectStoreAllReduce, ObjectStoreManager, build_diloco
from composer_diloco.object_store import PHASES
from composer_testkit.machine import cpu_model
from torch import nn
from tqdm.auto import tqdm

WORLD = 2
Timed = tuple[float, float, float]  # start, end (the monotonic clock all processes share), kernel CPU seconds


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)), nn.Linear(256, 1)
    )


def _threads(fn: Callable[[int], Any], world: int = WORLD) -> list[Any]:
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return out


def communication(sync_every: int, rounds: int, quantize: bool) -> dict[str, Any]:
    url = f"memory://bench-{uuid.uuid4().hex}"
    config = DiLoCoConfig(sync_every=sync_every, should_quantize=quantize)
    steps = sync_every * rounds

    def replica(rank: int) -> dict[str, Any]:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        store = ObjectStoreAllReduce(url, "comm", rank=rank, world_size=WORLD, timeout_s=120)
        manager = ObjectStoreManager(store)
        g = torch.Generator().manual_seed(rank)
        with build_diloco(manager, model, opt, config):
            for _ in range(steps):
                x = torch.randn(32, 256, generator=g)
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
        return {"written": store.bytes_written, "read": store.bytes_read, "syncs": manager.current_step()}

    res = _threads(replica)
    params = sum(p.numel() for p in _model().parameters())
    ddp_per_step = 2 * 2 * (WORLD - 1) / WORLD * params * 4  # ring all-reduce: sent + received, fp32
    diloco_per_step = (res[0]["written"] + res[0]["read"]) / steps
    return {
        "params": params,
        "world_size": WORLD,
        "sync_every": sync_every,
        "quantized": quantize,
        "inner_steps": steps,
        "syncs": res[0]["syncs"],
        "diloco_bytes_per_inner_step": diloco_per_step,
        "ddp_bytes_per_step": ddp_per_step,
        "ratio_diloco_over_ddp": diloco_per_step / ddp_per_step,
    }


def _s3_options() -> tuple[dict[str, Any], Any]:
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
    import s3fs

    s3fs.S3FileSystem(**options).mkdir("bench")
    return options, server


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _interleaved(
    url: str,
    reps: int,
    desc: str,
    stores: list[ObjectStoreAllReduce],
    ours: Callable[[int], float],
    raw: Callable[[int], float],
) -> tuple[list[float], list[float], list[float]]:
    """``reps`` times ``ours(rep)`` and ``raw(rep)`` (each returns its seconds), the order alternating rep by rep,
    each after the stores' pending deletions and, on file://, ``os.sync()`` (both outside the clock): (our
    times, the raw times, raw / ours per rep)."""
    # file://: flush dirty pages before each timed rep, so neither side pays the writeback of the other's
    # objects (at 512 MiB a round leaves 1 GiB dirty; that alone spread the ratio over 0.2-1.5)
    settle = os.sync if url.startswith("file://") else (lambda: None)
    t_ours: list[float] = []
    t_raw: list[float] = []
    for rep in tqdm(range(reps), desc=f"{url.split(':')[0]} {desc}", leave=False):
        for once, times in ((raw, t_raw), (ours, t_ours))[:: 1 if rep % 2 else -1]:
            for store in stores:  # deletions of old rounds overlap inner steps in training, not the clock
                store.wait_cleanup()
            settle()
            times.append(once(rep))
    return t_ours, t_raw, [r / o for r, o in zip(t_raw, t_ours, strict=True)]


def _timed_reps(
    rank: int,
    reps: int,
    desc: str,
    settle: Callable[[], None],
    ours: Callable[[int], Timed],
    raw: Callable[[int], Timed],
) -> tuple[list[Timed], list[Timed]]:
    """In one replica process: ``reps`` times ``ours(rep)`` and ``raw(rep)`` (each returns its :data:`Timed`), the
    order alternating rep by rep, each after ``settle`` (the store's pending deletions, a barrier, then on file://
    rank 0 flushes dirty pages), outside the clock."""
    t_ours: list[Timed] = []
    t_raw: list[Timed] = []
    for rep in tqdm(range(reps), desc=desc, leave=False, disable=rank != 0):
        for once, times in ((raw, t_raw), (ours, t_ours))[:: 1 if rep % 2 else -1]:
            settle()
            times.append(once(rep))
    return t_ours, t_raw


def round_replica(
    rank: int,
    url: str,
    run: str,
    numel: int,
    reps: int,
    options: dict[str, Any] | None,
    barrier: Any,
    tensors: int = 1,
) -> dict[str, Any]:
    """One replica process of the throughput bench: per rep, one ObjectStoreAllReduce round and one raw fsspec
    copy of the same bytes (``pipe_file`` its blob, then ``cat_file`` the other's with the store's ``cat_file``
    options), each started by a barrier of the replica processes; (start, end, kernel CPU seconds of this
    process) of each and the round's phases. Both start from a fresh copy of the tensor made before the clock:
    the round because it overwrites its tensors, the raw copy so that both meet the same memory state (where
    freed memory goes back to the host, as on a Firecracker VM with free page reporting, a write landing on
    handed-back pages pays host faults, kernel time the third field shows). With ``tensors`` > 1 the payload is
    that many tensors of their own (a model's or a LoRA adapter's parameters), the raw copy one blob of their
    bytes."""
    torch.set_num_threads(1)
    store = ObjectStoreAllReduce(
        url, run, rank=rank, world_size=WORLD, timeout_s=600, storage_options=options
    )
    values = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    parts = [c.clone() for c in values.chunk(tensors)]  # separate storages, as a model's parameters
    fs = store.fs
    cat_options = {"max_concurrency": 1} if url.startswith("s3://") else {}  # one GET, as the store reads
    raw_prefix = f"{store.root}/raw-{run}"
    local = url.startswith("file://")
    phases: list[dict[str, float]] = []

    def settle() -> None:
        store.wait_cleanup()  # deletions of old rounds overlap inner steps in training, not the clock
        barrier.wait()
        if local and rank == 0:  # flush dirty pages: neither side pays the writeback of the other's files
            os.sync()

    def ours(rep: int) -> Timed:
        work = [p.clone() for p in parts]
        barrier.wait()
        k0, t0 = _kernel_s(), time.perf_counter()
        store.allreduce(rep, work)
        t1, k1 = time.perf_counter(), _kernel_s()
        phases.append(dict(store.last.phases))
        return t0, t1, k1 - k0

    def raw(rep: int) -> Timed:
        folder = f"{raw_prefix}/{rep}"
        fs.makedirs(folder, exist_ok=True)
        blob = torch.cat(parts).numpy().tobytes()  # fresh memory, as the round's clone
        barrier.wait()
        k0, t0 = _kernel_s(), time.perf_counter()
        fs.pipe_file(f"{folder}/{rank}.bin", blob)
        barrier.wait()  # the same I/O as the all-reduce: write own blob, read the other's
        fs.cat_file(f"{folder}/{1 - rank}.bin", **cat_options)
        t1, k1 = time.perf_counter(), _kernel_s()
        barrier.wait()
        if rank == 0:
            fs.rm(folder, recursive=True)
        return t0, t1, k1 - k0

    desc = f"{url.split(':')[0]} throughput {numel * 4 / 2**20:g} MiB in {tensors} tensor(s)"
    t_ours, t_raw = _timed_reps(rank, reps, desc, settle, ours, raw)
    barrier.wait()
    if rank == 0:
        store.cleanup_run()
    return {"pid": os.getpid(), "ours": t_ours, "raw": t_raw, "phases": phases}


def _kernel_s() -> float:
    """CPU seconds this process (every thread) has spent in the kernel so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _replica_main(rank: int, kwargs: dict[str, Any], barrier: Any, results: Any) -> None:
    """A replica process: :func:`round_replica`, its result (or its traceback) put on ``results``; a failure
    breaks the barrier, so the other replica stops too."""
    try:
        results.put((rank, round_replica(rank=rank, barrier=barrier, **kwargs), None))
    except BaseException:
        barrier.abort()
        results.put((rank, None, traceback.format_exc()))


def _run_replicas(kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`round_replica` in ``WORLD`` fresh (spawned) processes sharing one barrier; their results by rank.
    A replica that dies without a result (killed, out of memory) ends the wait at once, named with its exit
    code; the other one is stopped."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(WORLD, timeout=1200), ctx.Queue()
    procs = [ctx.Process(target=_replica_main, args=(r, kwargs, barrier, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, Any]] = {}
    lost: set[int] = set()  # replicas found exited cleanly without their result
    try:
        while len(out) < WORLD:
            try:
                rank, value, error = results.get(timeout=2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r in out or p.exitcode is None:
                        continue
                    # a clean exit's result may still be in the pipe: two looks before it counts as lost
                    if p.exitcode != 0 or r in lost:
                        raise RuntimeError(
                            f"throughput replica {r} exited with code {p.exitcode} without a result"
                        ) from None
                    lost.add(r)
                continue
            if error is not None:
                raise RuntimeError(f"throughput replica {rank} failed:\n{error}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(30 if len(out) == WORLD else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(WORLD)]


def throughput(
    url: str, megabytes: float, reps: int, options: dict[str, Any] | None, tensors: int = 1
) -> dict[str, Any]:
    """One ObjectStoreAllReduce round against a raw fsspec copy of the same bytes (each replica ``pipe_file``s
    its blob, then ``cat_file``s the other's, with the same ``cat_file`` options the store uses), in 2 replica
    processes started together by a barrier, interleaved rep by rep, the order alternating. A rep's time runs
    from the first replica's start to the last one's end (one monotonic clock for every process). ``tensors``: the
    payload's number of tensors (:func:`round_replica`)."""
    numel = int(megabytes * 2**20 / 4)
    kwargs = {
        "url": url,
        "run": uuid.uuid4().hex[:8],
        "numel": numel,
        "reps": reps,
        "options": options,
        "tensors": tensors,
    }
    replicas = _run_replicas(kwargs)

    def spans(kind: str) -> list[float]:
        return [max(t[1] for t in rep) - min(t[0] for t in rep) for rep in zip(*(r[kind] for r in replicas))]

    def kernel(kind: str) -> list[float]:  # per rep, the mean over the replicas
        return [statistics.fmean(t[2] for t in rep) for rep in zip(*(r[kind] for r in replicas))]

    t_reduce, t_raw = spans("ours"), spans("raw")
    ratios = [r / o for r, o in zip(t_raw, t_reduce, strict=True)]
    phases = {
        p: [statistics.fmean(ph[p] for ph in rep) for rep in zip(*(r["phases"] for r in replicas))]
        for p in PHASES
    }
    payload = numel * 4
    return {
        "url": url.split(":")[0],
        "megabytes_per_replica": megabytes,
        "tensors": tensors,
        "replica_pids": [r["pid"] for r in replicas],
        "bench_pid": os.getpid(),
        "allreduce_s": _spread(t_reduce),
        "raw_copy_s": _spread(t_raw),
        "allreduce_MBps": payload / statistics.median(t_reduce) / 2**20,
        "raw_copy_MBps": payload / statistics.median(t_raw) / 2**20,
        "ratio_allreduce_over_raw": _spread(ratios),  # raw time / all-reduce time, per interleaved rep
        "phases_s": {p: _spread(v) for p, v in phases.items()},  # RoundStats.phases, mean of the replicas
        # CPU seconds a replica process spent in the kernel during the timed span (page cache, page faults, I/O)
        "kernel_s": {"allreduce": _spread(kernel("ours")), "raw_copy": _spread(kernel("raw"))},
        "reps": reps,
    }


def publish_alone(url: str, megabytes: float, reps: int, options: dict[str, Any] | None) -> dict[str, Any]:
    """One replica's publish (``RoundStats.phases["publish"]`` of a one-replica round: checksums, NaN/inf check
    and the create-only write of its object, streamed from the tensor's memory) against a raw fsspec
    ``pipe_file`` of the same bytes, interleaved rep by rep, the order alternating."""
    tensor = torch.randn(int(megabytes * 2**20 / 4), generator=torch.Generator().manual_seed(0))
    run = uuid.uuid4().hex[:8]
    store = ObjectStoreAllReduce(
        url, f"solo-{run}", rank=0, world_size=1, timeout_s=600, storage_options=options
    )
    fs, blob, raw_prefix = store.fs, tensor.numpy().tobytes(), f"{store.root}/rawwrite-{run}"

    def publish_once(rep: int) -> float:
        store.allreduce(rep, [tensor])  # the average of one replica leaves the tensor as it is
        return store.last.phases["publish"]

    def raw_once(rep: int) -> float:
        t0 = time.perf_counter()
        fs.pipe_file(f"{raw_prefix}/{rep}.bin", blob)
        return time.perf_counter() - t0

    fs.makedirs(raw_prefix, exist_ok=True)
    t_publish, t_raw, ratios = _interleaved(
        url, reps, f"publish {megabytes:g} MiB", [store], publish_once, raw_once
    )
    store.cleanup_run()
    fs.rm(raw_prefix, recursive=True)
    return {
        "url": url.split(":")[0],
        "megabytes_per_replica": megabytes,
        "publish_s": _spread(t_publish),
        "raw_write_s": _spread(t_raw),
        "ratio_publish_over_raw_write": _spread(ratios),  # raw write time / publish time, per interleaved rep
        "reps": reps,
    }


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def peak_replica(
    *,
    url: str,
    rank: int,
    world_size: int,
    numel: int,
    rounds: int,
    gate: str,
    options: dict[str, Any] | None,
) -> dict[str, Any]:
    """One replica process of the memory bench: ``rounds`` full-exchange rounds; the peak RSS over
    them (VmHWM, reset after the input tensor exists) minus the RSS before, over the payload."""
    torch.set_num_threads(1)
    store = ObjectStoreAllReduce(
        url, "peak", rank=rank, world_size=world_size, timeout_s=600, storage_options=options
    )
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    store.rounds_present()  # the store's client is set up (botocore loads its models) before the baseline
    print(f"ready rank={rank}", flush=True)
    _wait_gate(gate)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    rss0 = _status("VmRSS")
    for r in range(rounds):
        store.allreduce(r, [x])
    return {"payload": numel * 4, "peak_growth": _status("VmHWM") - rss0}


def _wait_gate(gate: str) -> None:
    deadline = time.monotonic() + 600
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError("gate never opened")
        time.sleep(0.02)


def _processes(target: str, kwargs: dict[str, Any], world: int, workdir: Path, tag: str) -> list[Any]:
    """Run ``target`` in ``world`` replica processes started together through a gate file."""
    from composer_diloco.executors import ReplicaProcess

    gate = workdir / f"gate-{tag}"
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    procs = [
        ReplicaProcess(r, f"bench_diloco:{target}", {**kwargs, "rank": r, "gate": str(gate)}, workdir, env)
        for r in range(world)
    ]
    deadline = time.monotonic() + 600
    for p in procs:
        while "ready rank=" not in p.log_text():
            if p.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica {p.rank} did not start: {p.log_text()[-2000:]}")
            time.sleep(0.05)
    gate.touch()
    results = []
    for p in procs:
        res = p.finish(1200)
        if res.exit_code != 0:
            raise RuntimeError(f"replica {p.rank} failed: {res.log_tail}")
        results.append(res.value)
    return results


def peak_memory(url: str, megabytes: float, options: dict[str, Any] | None, workdir: Path) -> dict[str, Any]:
    numel = int(megabytes * 2**20 / 4)
    kwargs = {"url": url, "world_size": WORLD, "numel": numel, "rounds": 3, "options": options}
    tag = f"peak-{url.split(':')[0]}-{megabytes:g}"
    growth = [
        r["peak_growth"] / r["payload"] for r in _processes("peak_replica", kwargs, WORLD, workdir, tag)
    ]
    return {
        "url": url.split(":")[0],
        "megabytes_per_replica": megabytes,
        "peak_growth_over_payload": max(growth),
    }


def scale_replica(
    *, url: str, rank: int, world_size: int, numel: int, rounds: int, gate: str, timeout_s: float = 600.0
) -> dict[str, Any]:
    """One replica process of the scaling bench: per round, the full then the sharded exchange
    (two runs in one store), each on fresh random values; bytes read and seconds per round."""
    torch.set_num_threads(1)
    stores = {
        mode: ObjectStoreAllReduce(
            url, mode, rank=rank, world_size=world_size, timeout_s=timeout_s, exchange=mode
        )
        for mode in ("full", "sharded")
    }
    g = torch.Generator().manual_seed(rank)
    print(f"ready rank={rank}", flush=True)
    _wait_gate(gate)
    out: dict[str, list[dict[str, float]]] = {mode: [] for mode in stores}
    for r in range(rounds):
        for mode, store in stores.items():
            x = torch.randn(numel, generator=g)
            stats = store.allreduce(r, [x])
            out[mode].append({"read": stats.bytes_read, "seconds": stats.seconds})
    return {"payload": numel * 4, **out}


def scaling(world: int, megabytes: float, rounds: int, workdir: Path) -> list[dict[str, Any]]:
    numel = int(megabytes * 2**20 / 4)
    kwargs = {
        "url": f"file://{workdir / f'store-{world}'}",
        "world_size": world,
        "numel": numel,
        "rounds": rounds,
    }
    results = _processes("scale_replica", kwargs, world, workdir, f"scale-{world}")
    rows = []
    for mode in ("full", "sharded"):
        reads = [x["read"] / r["payload"] for r in results for x in r[mode][1:]]  # round 0 warms up
        secs = [x["seconds"] for r in results for x in r[mode][1:]]
        rows.append(
            {
                "k": world,
                "exchange": mode,
                "megabytes_per_replica": megabytes,
                "read_over_payload": _spread(reads),
                "round_s": _spread(secs),
                "rounds": rounds,
            }
        )
    return rows


def machine() -> dict[str, Any]:
    return {
        "threads": torch.get_num_threads(),  # per replica (set to 1 in main and in every replica process)
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "load_average": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "page_reporting": page_reporting(),
    }


def page_reporting() -> dict[str, int] | None:
    """The guest kernel's free page reporting (freed memory handed back to the host, as Firecracker's balloon
    does), None where it is off or unreadable: ``order`` (smallest block reported, log2 pages) and
    ``min_free_ms`` (how long a block stays free before it is reported)."""
    folder = Path("/sys/module/page_reporting/parameters")
    try:
        return {
            "order": int((folder / "page_reporting_order").read_text()),
            "min_free_ms": int((folder / "min_free_ms").read_text()),
        }
    except (OSError, ValueError):
        return None


def readme(results: dict[str, Any]) -> dict[str, Any]:
    rows: list[list[Any]] = []
    peaks = {
        (p["url"], p["megabytes_per_replica"]): p["peak_growth_over_payload"] for p in results["peak_memory"]
    }
    for r in results["throughput"]:
        ratio = r["ratio_allreduce_over_raw"]
        peak = peaks.get((r["url"], r["megabytes_per_replica"])) if r.get("tensors", 1) == 1 else None
        rows.append(
            [
                f"round vs raw fsspec copy (k=2, full{_tensors_label(r)})",
                r["url"],
                2,
                r["megabytes_per_replica"],
                f"{ratio['median']:.2f} [{ratio['min']:.2f}–{ratio['max']:.2f}]",
                "",
                "" if peak is None else f"{peak:.2f}",
                round(r["allreduce_s"]["median"], 4),
                round(r["raw_copy_s"]["median"], 4),
                " / ".join(_ms(r["phases_s"][p]["median"]) for p in PHASES),
            ]
        )
    for r in results["publish"]:
        ratio = r["ratio_publish_over_raw_write"]
        rows.append(
            [
                "one replica's publish vs raw fsspec write (k=1)",
                r["url"],
                1,
                r["megabytes_per_replica"],
                f"{ratio['median']:.2f} [{ratio['min']:.2f}–{ratio['max']:.2f}]",
                "",
                "",
                round(r["publish_s"]["median"], 4),
                round(r["raw_write_s"]["median"], 4),
                "",
            ]
        )
    for r in results["scaling"]:
        read = r["read_over_payload"]
        rows.append(
            [
                f"replicas as processes, {r['exchange']} exchange",
                "file",
                r["k"],
                r["megabytes_per_replica"],
                "",
                f"{read['median']:.2f} (max {read['max']:.2f})",
                "",
                round(r["round_s"]["median"], 4),
                "",
                "",
            ]
        )
    load = results["machine"]["load_average"][0]
    return {
        "title": "Serverless DiLoCo: object-store all-reduce throughput, memory and cost per replica against k",
        "columns": [
            "measurement",
            "store",
            "k",
            "MiB / replica",
            "raw copy (write) time / round (publish) time (median [min–max])",
            "bytes read / payload per replica-round (median)",
            "peak RSS growth / payload per replica (max)",
            "round (publish) s (median)",
            "raw copy (write) s (median)",
            f"round's ms per phase: {' / '.join(PHASES)} (median)",
        ],
        "rows": rows,
        "note": "ratio 1 = as fast as a raw copy of the same bytes (each replica writes its blob and reads the "
        "other's; the round also checksums, validates, averages and agrees on a manifest); 2 replica processes "
        f"(started together by a barrier; a rep runs from the first one's start to the last one's end) share "
        f"{os.cpu_count()} CPU threads with moto's S3 server (the bench's process), torch 1 thread per replica, "
        f"load average {load:.1f} at the end; peak RSS from replica processes (VmHWM over 3 rounds); "
        "phases as in `RoundStats.phases` (each from the end of the one before; mean of the 2 replicas): publish "
        "= encode + create its object, commit = wait for and validate the other's object until the manifest is "
        "committed, reduce = checks and staged sums, accept = write its marker and read the other's, apply = "
        "the average into the tensors; publish rows: one replica alone, its publish phase against a raw fsspec "
        "`pipe_file` of the same bytes; both sides of a round row start from a fresh copy of the tensor, made "
        f"outside the clock{_reporting_note(results['machine'].get('page_reporting'))}; see `machine` in the JSON.",
    }


def _tensors_label(row: dict[str, Any]) -> str:
    n = row.get("tensors", 1)
    return "" if n == 1 else f", {n} tensors"


def _reporting_note(reporting: dict[str, int] | None) -> str:
    if not reporting:
        return ""
    return (
        f" (this VM hands freed memory back to the host: free page reporting of blocks of 2^{reporting['order']} "
        f"pages after {reporting['min_free_ms']} ms, so a write that lands on handed-back pages pays host faults; "
        "`kernel_s` in the JSON holds each side's kernel CPU time)"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


SIZES = {  # MiB per replica: (file:// reps, s3:// reps); an s3 rep at 512 MiB takes ~40 s, a file:// one ~4 s. A 1 MiB
    # rep takes milliseconds and its ratio spreads 0.15-0.7 from rep to rep on a shared VM: 101 of them (15 before)
    # keep the median from moving with a handful of reps (five runs of 15 gave 0.32-0.54)
    "small": [(1.0, 5, 5), (16.0, 3, 3)],
    "default": [(1.0, 101, 101), (16.0, 9, 9), (64.0, 11, 11)],
    "large": [(512.0, 11, 5)],
}
LARGE_ENV = "COMPOSER_BENCH_LARGE"
# the 1 MiB round again with the payload in this many tensors: a LoRA adapter's or a small model's parameter count,
# where what a round costs per tensor (encode, checksum, decode, average) shows
MANY_TENSORS = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CI's check-it-works size: 1 and 16 MiB only")
    parser.add_argument(
        "--large", action="store_true", help=f"also 512 MiB (~6 GiB of RAM; or set ${LARGE_ENV}=1)"
    )
    args = parser.parse_args()
    large = args.large or os.environ.get(LARGE_ENV, "") not in ("", "0")
    torch.set_num_threads(1)
    out_dir = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "machine": machine(),
        "small": args.small,
        "large": large,
        "communication": [],
        "throughput": [],
        "publish": [],
        "peak_memory": [],
    }
    for h, q in [(50, False), (50, True), (10, False)]:
        results["communication"].append(communication(h, rounds=2, quantize=q))
    sizes = SIZES["small"] if args.small else SIZES["default"] + (SIZES["large"] if large else [])
    options, server = _s3_options()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for mb, file_reps, s3_reps in sizes:
                for url, opts, reps in (
                    (f"file://{tmp}/tp", None, file_reps),
                    ("s3://bench/tp", options, s3_reps),
                ):
                    results["throughput"].append(throughput(url, mb, reps=reps, options=opts))
                    results["publish"].append(publish_alone(url, mb, reps=reps, options=opts))
            mb, file_reps, s3_reps = sizes[0]
            for url, opts, reps in (
                (f"file://{tmp}/tpn", None, file_reps),
                ("s3://bench/tpn", options, s3_reps),
            ):
                results["throughput"].append(
                    throughput(url, mb, reps=reps, options=opts, tensors=MANY_TENSORS)
                )
            for mb, *_ in sizes[1:]:  # 1 MiB: RSS noise exceeds the payload
                for url, opts in ((f"file://{tmp}/peak-{mb:g}", None), (f"s3://bench/peak-{mb:g}", options)):
                    results["peak_memory"].append(peak_memory(url, mb, opts, Path(tmp)))
    finally:
        server.stop()
    results["scaling"] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (2, 4) if args.small else (2, 4, 8):
            results["scaling"].extend(
                scaling(world, 1.0 if args.small else 16.0, 3 if args.small else 4, Path(tmp))
            )
    results["machine"] = machine()  # load average at the end of the run
    results["readme"] = readme(results)
    report(results, out_dir)


def report(results: dict[str, Any], out_dir: Path) -> None:
    print("\n== bytes per inner step: DiLoCo (object store, measured) vs DDP (ring all-reduce, fp32) ==")
    print(f"{'H':>4} {'fp8':>5} {'params':>9} {'DiLoCo B/step':>14} {'DDP B/step':>12} {'ratio':>8}")
    for r in results["communication"]:
        print(
            f"{r['sync_every']:>4} {r['quantized']!s:>5} {r['params']:>9} {r['diloco_bytes_per_inner_step']:>14.0f} "
            f"{r['ddp_bytes_per_step']:>12.0f} {r['ratio_diloco_over_ddp']:>8.4f}"
        )
    print("\n== all-reduce round vs raw fsspec copy of the same bytes (2 replicas; raw time / round time) ==")
    _print_ratios(
        results["throughput"],
        ("allreduce_s", "raw_copy_s", "ratio_allreduce_over_raw"),
        lambda r: (
            " ".join(f"{p} {_ms(r['phases_s'][p]['median'])}" for p in PHASES) + f" ms{_tensors_label(r)}"
        ),
    )
    print("\n== one replica's publish vs raw fsspec write of the same bytes (raw time / publish time) ==")
    _print_ratios(results["publish"], ("publish_s", "raw_write_s", "ratio_publish_over_raw_write"))
    print("\n== peak RSS growth per replica over 3 rounds (processes, k=2) / payload ==")
    for r in results["peak_memory"]:
        print(f"{r['url']:>6} {r['megabytes_per_replica']:>6.0f} MiB: {r['peak_growth_over_payload']:.2f}")
    print("\n== scale in replicas (processes, file://): bytes read / payload and round time per replica ==")
    for r in results["scaling"]:
        print(
            f"k={r['k']} {r['exchange']:>8}: read/payload {r['read_over_payload']['median']:.2f} "
            f"(max {r['read_over_payload']['max']:.2f}), round {r['round_s']['median']:.3f} s "
            f"[{r['round_s']['min']:.3f}-{r['round_s']['max']:.3f}]"
        )
    path = out_dir / "diloco.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {path}")
    plot(results, out_dir)


def _print_ratios(
    rows: list[dict[str, Any]],
    keys: tuple[str, str, str],
    extra: Callable[[dict[str, Any]], str] = lambda r: "",
) -> None:
    """One line per row: store, MiB, the medians of ``keys`` (ours, the anchor's) and their ratio's spread."""
    ours, anchor, ratio = keys
    print(f"{'store':>6} {'MiB':>6} {'ours s':>9} {'anchor s':>9} {'ratio median [min-max]':>24}")
    for r in rows:
        q = r[ratio]
        print(
            f"{r['url']:>6} {r['megabytes_per_replica']:>6.0f} {r[ours]['median']:>9.4f} "
            f"{r[anchor]['median']:>9.4f} {q['median']:>8.3f} [{q['min']:.3f}-{q['max']:.3f}]  {extra(r)}"
        )


def plot(results: dict[str, Any], out_dir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    tp = results["throughput"]
    a.bar(
        [
            f"{r['url']}\n{r['megabytes_per_replica']:.0f} MiB{_tensors_label(r).replace(', ', chr(10))}"
            for r in tp
        ],
        [r["ratio_allreduce_over_raw"]["median"] for r in tp],
    )
    a.axhline(1.0, color="k", lw=0.5)
    a.tick_params(axis="x", labelsize=8)
    for target, label in ((0.8, "target 64/512 MiB"), (0.5, "target 1 MiB")):
        a.axhline(target, color="r", lw=0.5, ls="--")
        a.annotate(label, (a.get_xlim()[0], target), fontsize=7, color="r", va="bottom")
    a.set_title("raw copy time / all-reduce round time (k=2)")
    for mode, marker in (("full", "o"), ("sharded", "s")):
        rows = [r for r in results["scaling"] if r["exchange"] == mode]
        ks = [r["k"] for r in rows]
        b.plot(ks, [r["read_over_payload"]["median"] for r in rows], marker=marker, label=mode)
        c.plot(ks, [r["round_s"]["median"] for r in rows], marker=marker, label=mode)
    b.axhline(2.5, color="r", lw=0.5, ls="--")
    b.annotate("target (sharded)", (2, 2.5), fontsize=7, color="r", va="bottom")
    b.set_title("bytes read per replica per round / payload")
    c.set_title("round time per replica (s)")
    for ax in (b, c):
        ax.set_xlabel("replicas k")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "diloco.png", dpi=100)
    print(f"wrote {out_dir / 'diloco.png'}")


if __name__ == "__main__":
    main()
