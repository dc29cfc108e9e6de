"""composer-diloco benchmark (run by ``nox -s bench``).

1. Communication: bytes a replica exchanges per *inner* step with torchft's DiLoCo on the
   serverless ObjectStoreManager (measured: bytes written + read through the store, two replicas,
   fp32 and fp8-quantised), against what DDP would exchange for the same model every step
   (ring all-reduce of fp32 gradients: 2·(k−1)/k·P·4 bytes sent and as many received).
2. Throughput: ObjectStoreAllReduce (encode + checksum + atomic write + manifest + validated
   read + average) against a raw fsspec copy of the same bytes (each replica writes its blob and
   reads the other's), over file:// and s3:// (moto's server on 127.0.0.1).

Prints a table and writes JSON (and a PNG when matplotlib is installed) to $COMPOSER_BENCH_OUT.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from composer_diloco import DiLoCoConfig, ObjectStoreAllReduce, ObjectStoreManager, build_diloco
from torch import nn
from tqdm.auto import tqdm

WORLD = 2


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


def throughput(url: str, megabytes: float, reps: int, options: dict[str, Any] | None) -> dict[str, Any]:
    numel = int(megabytes * 2**20 / 4)
    tensors = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)]
    payload = numel * 4
    run = uuid.uuid4().hex[:8]
    stores = [
        ObjectStoreAllReduce(url, run, rank=r, world_size=WORLD, timeout_s=120, storage_options=options)
        for r in range(WORLD)
    ]
    fs = stores[0].fs
    raw_prefix = f"{stores[0].root}/raw-{run}"
    blobs = [t.numpy().tobytes() for t in tensors]
    t_reduce, t_raw = [], []
    for rep in tqdm(range(reps), desc=f"throughput {url.split(':')[0]}", leave=False):
        work = [[t.clone()] for t in tensors]
        t0 = time.perf_counter()
        _threads(lambda r, rep=rep, work=work: stores[r].allreduce(rep, work[r]))
        t_reduce.append(time.perf_counter() - t0)

        fs.makedirs(f"{raw_prefix}/{rep}", exist_ok=True)
        barrier = threading.Barrier(WORLD)

        def raw(r: int, rep: int = rep, barrier: threading.Barrier = barrier) -> None:
            fs.pipe_file(f"{raw_prefix}/{rep}/{r}.bin", blobs[r])
            barrier.wait()  # the same I/O as the all-reduce: write own blob, read the other's
            fs.cat_file(f"{raw_prefix}/{rep}/{1 - r}.bin")

        t0 = time.perf_counter()
        _threads(raw)
        t_raw.append(time.perf_counter() - t0)
    stores[0].cleanup_run()
    fs.rm(raw_prefix, recursive=True)
    best_reduce, best_raw = min(t_reduce), min(t_raw)
    return {
        "url": url.split(":")[0],
        "megabytes_per_replica": megabytes,
        "allreduce_MBps": payload / best_reduce / 2**20,
        "raw_copy_MBps": payload / best_raw / 2**20,
        "ratio_allreduce_over_raw": best_raw / best_reduce,
        "reps": reps,
    }


def main() -> None:
    out_dir = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"communication": [], "throughput": []}
    for h, q in [(50, False), (50, True), (10, False)]:
        results["communication"].append(communication(h, rounds=2, quantize=q))
    options, server = _s3_options()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for mb in (1.0, 16.0):
                results["throughput"].append(throughput(f"file://{tmp}", mb, reps=5, options=None))
                results["throughput"].append(throughput("s3://bench/tp", mb, reps=3, options=options))
    finally:
        server.stop()

    print("\n== bytes per inner step: DiLoCo (object store, measured) vs DDP (ring all-reduce, fp32) ==")
    print(f"{'H':>4} {'fp8':>5} {'params':>9} {'DiLoCo B/step':>14} {'DDP B/step':>12} {'ratio':>8}")
    for r in results["communication"]:
        print(
            f"{r['sync_every']:>4} {r['quantized']!s:>5} {r['params']:>9} {r['diloco_bytes_per_inner_step']:>14.0f} "
            f"{r['ddp_bytes_per_step']:>12.0f} {r['ratio_diloco_over_ddp']:>8.4f}"
        )
    print("\n== all-reduce throughput vs raw fsspec copy of the same bytes (2 replicas) ==")
    print(f"{'store':>6} {'MB':>6} {'allreduce MB/s':>15} {'raw MB/s':>10} {'ratio':>7}")
    for r in results["throughput"]:
        print(
            f"{r['url']:>6} {r['megabytes_per_replica']:>6.1f} {r['allreduce_MBps']:>15.1f} "
            f"{r['raw_copy_MBps']:>10.1f} {r['ratio_allreduce_over_raw']:>7.3f}"
        )
    path = out_dir / "diloco.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    comm = results["communication"]
    a.bar(
        [f"H={r['sync_every']}{' fp8' if r['quantized'] else ''}" for r in comm],
        [r["ratio_diloco_over_ddp"] for r in comm],
    )
    a.set_yscale("log")
    a.set_title("bytes per inner step, DiLoCo / DDP")
    tp = results["throughput"]
    b.bar(
        [f"{r['url']} {r['megabytes_per_replica']:.0f}MB" for r in tp],
        [r["ratio_allreduce_over_raw"] for r in tp],
    )
    b.axhline(1.0, color="k", lw=0.5)
    b.set_title("all-reduce / raw fsspec copy throughput")
    fig.tight_layout()
    fig.savefig(out_dir / "diloco.png", dpi=100)
    print(f"wrote {out_dir / 'diloco.png'}")


if __name__ == "__main__":
    main()
