"""Bypass (blockwise) distillation vs full-model logit distillation (KL) of the same student, CPU.

Both train the same pruned student (FFN halved, KV heads halved) from the same teacher on the
same token batches, with AdamW over the same block parameters (embeddings and LM head frozen):

* bypass: the engine's own step (:func:`composer_core.bypass.train.bypass_step`, what
  ``run_bypass`` runs each step): one no-grad teacher forward without the LM head, then each
  student block on the teacher's block input with normalised MSE and its own AdamW.
* KL: teacher logits (no grad), student full forward to logits, forward KL(teacher‖student)
  over the vocabulary, backward through the whole student, one AdamW.

Timing alternates the two methods step by step in one process (median wall and CPU time per
step), so a noisy shared machine slows both alike; one intra-op thread by default
(``COMPOSER_BENCH_THREADS``) because oversubscribed OpenMP threads stall at barriers and
distort small-op timings. Peak memory: each method runs alone in a child process
and reports how far its peak RSS (VmHWM, reset after setup and the first step) rises above
the RSS before the measured steps: activations, gradients and temporaries of one step. Model shape follows Qwen2.5-0.5B's
proportions (LM head ≈ 40 % of the forward FLOPs), scaled down. Writes JSON to
$COMPOSER_BENCH_OUT (default ./bench-results).

Distributed part (``bench_bypass_dist.json`` + ``bench_bypass_dist.png``): the engine on k = 1, 2, 4 real
processes (gloo, CPU, one thread each) on an 8-block model saved as a sharded safetensors checkpoint
(``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``), in two modes:

* owned: each rank loads only its teacher blocks (``load_model(path, Ownership)``, one tensor at a time)
  and builds only its student blocks (the engine's default);
* full: every rank loads the whole teacher (norm and LM head included) and builds the whole student
  (``make_student(..., ownership=None)``, the path of ``run_bypass(hold_all_blocks=True)``: the former
  every-rank-holds-everything mode), then trains only its blocks.

Both run the engine's ``bypass_step`` (wavefront pipeline over ``grad_accum`` micro-batches, no barrier
between steps). Reported per configuration: the largest per-rank peak RSS (VmHWM) and parameter bytes
held, group tokens/s (per step: the slowest rank's step time; median and min–max over the timed steps of
every round), the speedup over full-model KL distillation of the same student in one process (timed in
the same rounds), and a FLOP model of the ideal speedup: KL FLOPs per token over the FLOPs of the
slowest rank, with at most ``cpu_count`` ranks running at once (:func:`flop_model`). Rounds interleave
the configurations (order reversed every other round).

``--small`` is CI's check that the bench works: both parts, every method and every k, on tiny models with
one round (the JSONs record ``"small": true``).

    python bench/bench_bypass.py [--part all|single|dist] [--rounds 2] [--steps 4] [--small]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# composer_testkit: composer-core's tests/support, never shipped (CONTRIBUTING.md, Test support)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "composer-core" / "tests" / "support"))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from composer_core import __version__
from composer_core.bypass import (
    BlockOverride,
    ReferenceConfig,
    ReferenceDecoder,
    TrainingConfig,
    build_student,
    load_model,
    materialised_bytes,
)
from composer_core.bypass.config import StudentConfig
from composer_core.bypass.data import TokenBatches, synthetic_tokens
from composer_core.bypass.distributed import DistContext
from composer_core.bypass.keys import freeze_for_training
from composer_core.bypass.train import bypass_step, make_optimizers, make_student
from composer_testkit.machine import cpu_model
from safetensors.torch import load_file, save_file

SMALL = "--small" in sys.argv[1:]
"""``--small``, read at import (argparse accepts it too) so that every process of the bench has the same sizes:
the memory children get ``--small`` on their command line, the forkserver ranks re-import this script with the
parent's ``sys.argv``."""

MODEL = {
    "vocab_size": 16384,
    "hidden_size": 384,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 8,
    "intermediate_size": 2048,
}
STUDENT = [BlockOverride(intermediate_size=1024, num_key_value_heads=4)]
SEQ, BATCH, WARM, STEPS = 256, 8, 2, 8
if SMALL:  # CI's check that the bench works: the same code paths on a tiny model, a few steps
    MODEL = {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 4,
        "intermediate_size": 256,
    }
    STUDENT = [BlockOverride(intermediate_size=128, num_key_value_heads=2)]
    SEQ, BATCH, WARM, STEPS = 32, 2, 1, 2
THREADS = int(os.environ.get("COMPOSER_BENCH_THREADS", "1"))
TCFG = TrainingConfig(steps=WARM + STEPS, micro_batch_size=BATCH, lr=1e-4, clip="norm", clip_value=1.0)


def _setup() -> tuple[ReferenceDecoder, TokenBatches]:
    torch.manual_seed(0)
    teacher = ReferenceDecoder(ReferenceConfig(**MODEL)).eval()  # type: ignore[arg-type]
    teacher.requires_grad_(False)
    ids = synthetic_tokens(MODEL["vocab_size"], 64, SEQ, seed=1)
    return teacher, TokenBatches(ids, micro_batch_size=BATCH, seed=0)


def bypass_runner(teacher: ReferenceDecoder, data: TokenBatches) -> Callable[[int], None]:
    student = build_student(teacher, STUDENT)
    blocks = range(student.num_blocks)
    optimizers = make_optimizers(student, blocks, TCFG)
    return lambda k: (
        bypass_step(teacher, student, optimizers, blocks, [data.batch(k)], DistContext(), TCFG, 1e-4),
        None,
    )[1]


def kl_runner(teacher: ReferenceDecoder, data: TokenBatches) -> Callable[[int], None]:
    return kl_parts(teacher, data)[0]


def kl_parts(
    teacher: Any, data: TokenBatches, overrides: Sequence[BlockOverride] = STUDENT, accum: int = 1
) -> tuple[Callable[[int], None], Any]:
    """Full-model logit distillation (step, student): step ``k`` uses batches ``k·accum … k·accum + accum − 1``."""
    student = build_student(teacher, overrides)
    params = [
        p
        for ps in freeze_for_training(student, range(student.num_blocks), ("entire_block",)).values()
        for p in ps
    ]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=TCFG.betas, fused=True)

    def step(k: int) -> None:
        for j in range(accum):
            batch = data.batch(k * accum + j)
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(batch).float(), -1)
            s_logp = F.log_softmax(student(batch).float(), -1)  # type: ignore[operator]
            kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")  # KL(teacher‖student)
            (kl / accum).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, student


RUNNERS = {"bypass": bypass_runner, "kl": kl_runner}


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_child(method: str) -> None:
    """Peak RSS growth over the RSS after setup; VmHWM is reset first (Linux ``clear_refs`` 5)."""
    teacher, data = _setup()
    step = RUNNERS[method](teacher, data)
    step(0)  # the first step allocates optimizer state; it is not counted
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_mib("VmRSS")
    for k in range(1, 4):
        step(k)
    peak = _status_mib("VmHWM")
    print(json.dumps({"peak_rss_mib": peak, "training_peak_growth_mib": peak - base}))


def machine(threads: int, **extra: Any) -> dict[str, Any]:
    """The JSON's "machine" block (CONTEXT: bench JSON)."""
    return {
        "processor": cpu_model(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "load_average": list(os.getloadavg()),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "composer_core": __version__,
        **extra,
    }


def _write(name: str, payload: dict[str, Any]) -> Path:
    out = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(payload, indent=1))
    print(f"wrote {out / name}")
    return out / name


def single_process() -> None:
    """Bypass vs KL on the 4-block model in one process (steps alternate), memory in child processes."""
    teacher, data = _setup()
    steps = {m: make(teacher, data) for m, make in RUNNERS.items()}
    wall: dict[str, list[float]] = {m: [] for m in RUNNERS}
    cpu: dict[str, list[float]] = {m: [] for m in RUNNERS}
    for k in range(WARM + STEPS):
        order = list(RUNNERS) if k % 2 == 0 else list(reversed(RUNNERS))
        for m in order:
            t0, c0 = time.perf_counter(), time.process_time()
            steps[m](k)
            if k >= WARM:
                wall[m].append(time.perf_counter() - t0)
                cpu[m].append(time.process_time() - c0)
    tokens = BATCH * SEQ
    results: dict[str, dict[str, float]] = {}
    for m in RUNNERS:
        med, med_cpu = statistics.median(wall[m]), statistics.median(cpu[m])
        cmd = [sys.executable, __file__, "--memory", m, *(["--small"] if SMALL else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[m] = {
            "median_step_s": med,
            "tokens_per_s": tokens / med,
            "tokens_per_s_min": tokens / max(wall[m]),
            "tokens_per_s_max": tokens / min(wall[m]),
            "median_step_cpu_s": med_cpu,
            "tokens_per_cpu_s": tokens / med_cpu,
            **json.loads(proc.stdout.splitlines()[-1]),
        }
    cpu_ratio = results["bypass"]["tokens_per_cpu_s"] / results["kl"]["tokens_per_cpu_s"]
    ratio = results["bypass"]["tokens_per_s"] / results["kl"]["tokens_per_s"]
    mem = results["bypass"]["training_peak_growth_mib"] / max(results["kl"]["training_peak_growth_mib"], 1e-9)
    student = STUDENT[0]
    print(
        f"model {MODEL}; student FFN {student.intermediate_size}, KV heads {student.num_key_value_heads}; "
        f"batch {BATCH}x{SEQ}; {STEPS} timed steps each, alternating"
    )
    print(
        f"{'method':>8} {'tokens/s':>10} {'tokens/CPU-s':>13} {'peak RSS MiB':>13} {'train growth MiB':>17}"
    )
    for m, r in results.items():
        print(
            f"{m:>8} {r['tokens_per_s']:10.0f} {r['tokens_per_cpu_s']:13.0f} {r['peak_rss_mib']:13.0f}"
            f" {r['training_peak_growth_mib']:17.0f}"
        )
    print(
        f"bypass / KL tokens/s: {ratio:.2f}x wall, {cpu_ratio:.2f}x per CPU-second (target >= 2x); "
        f"bypass / KL training memory growth: {mem:.2f}"
    )
    rows = [
        [
            m,
            f"{r['tokens_per_s']:.0f} [{r['tokens_per_s_min']:.0f}–{r['tokens_per_s_max']:.0f}]",
            round(r["tokens_per_cpu_s"]),
            round(r["peak_rss_mib"]),
            round(r["training_peak_growth_mib"]),
        ]
        for m, r in results.items()
    ]
    _write(
        "bench_bypass.json",
        {
            "model": MODEL,
            "batch": BATCH,
            "seq": SEQ,
            "steps": STEPS,
            "small": SMALL,
            "results": results,
            "tokens_per_s_ratio": ratio,
            "tokens_per_cpu_s_ratio": cpu_ratio,
            "memory_growth_ratio": mem,
            "torch_threads": torch.get_num_threads(),
            "machine": machine(torch.get_num_threads()),
            "readme": {
                "title": f"Bypass vs full-model KL distillation, one process: {STEPS} alternating steps of "
                f"{BATCH}×{SEQ} tokens, median [min–max]",
                "columns": ["method", "tokens/s", "tokens/CPU-s", "peak RSS MiB", "training growth MiB"],
                "rows": rows,
                "note": f"bypass / KL: {ratio:.2f}× tokens/s, {cpu_ratio:.2f}× per CPU-second, "
                f"{mem:.2f}× training memory growth.",
            },
        },
    )


# ---------------------------------------------------------------------------------------------------
# Distributed part: k real processes, owned vs full mode, and KL in one process on the same model.
# ---------------------------------------------------------------------------------------------------

DIST_MODEL = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "num_layers": 8,
    "num_heads": 8,
    "num_kv_heads": 8,
    "intermediate_size": 1024,
}
DIST_STUDENT = (BlockOverride(intermediate_size=512, num_key_value_heads=4),)
DIST_SEQ, DIST_MB, DIST_ACCUM, DIST_WARM, DIST_STEPS = 64, 2, 4, 1, 4
DIST_ROUNDS = 2
WORLDS = (1, 2, 4)
SHARDS = 4  # block-group shards of the saved teacher, plus one for embedding / norm / head
if SMALL:  # every k and both modes, on 4 tiny blocks (one per rank at k = 4), one round of one timed step
    DIST_MODEL = {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 4,
        "intermediate_size": 128,
    }
    DIST_STUDENT = (BlockOverride(intermediate_size=64, num_key_value_heads=2),)
    DIST_SEQ, DIST_MB, DIST_ACCUM, DIST_WARM, DIST_STEPS = 16, 1, 2, 1, 1
    DIST_ROUNDS, SHARDS = 1, 2
DIST_TCFG = TrainingConfig(
    steps=DIST_WARM + DIST_STEPS,
    micro_batch_size=DIST_MB,
    grad_accum=DIST_ACCUM,
    lr=1e-4,
    clip="norm",
    clip_value=1.0,
)


def save_sharded_teacher(path: Path) -> Path:
    """The teacher as an HF-style sharded checkpoint: ``model-0000i-of-0000n.safetensors`` + index json."""
    torch.manual_seed(0)
    ReferenceDecoder(ReferenceConfig(**DIST_MODEL)).save(path)  # type: ignore[arg-type]
    whole = load_file(str(path / "model.safetensors"))
    n, per = SHARDS + 1, DIST_MODEL["num_layers"] // SHARDS
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in whole.items():
        i = int(name.split(".")[1]) // per + 1 if name.startswith("layers.") else n
        groups.setdefault(f"model-{i:05d}-of-{n:05d}.safetensors", {})[name] = t
    for file, tensors in groups.items():
        save_file(tensors, str(path / file), metadata={"format": "pt"})
    weight_map = {k: f for f, ts in groups.items() for k in ts}
    total = sum(t.numel() * t.element_size() for t in whole.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (path / "model.safetensors").unlink()
    return path


def _dist_data(steps: int = DIST_STEPS) -> TokenBatches:
    n = (DIST_WARM + steps) * DIST_ACCUM * DIST_MB
    ids = synthetic_tokens(DIST_MODEL["vocab_size"], n, DIST_SEQ, seed=1)
    return TokenBatches(ids, micro_batch_size=DIST_MB, seed=0)


def _timed(step: Callable[[int], None], ctx: DistContext, steps: int) -> list[float]:
    """Seconds of every timed step on this rank (no barrier between steps: the pipeline keeps flowing)."""
    times = []
    ctx.barrier()
    for k in range(DIST_WARM + steps):
        t0 = time.perf_counter()
        step(k)
        if k >= DIST_WARM:
            times.append(time.perf_counter() - t0)
    ctx.barrier()
    return times


def _bypass_step_fn(mode: str, path: Path, ctx: DistContext, steps: int) -> tuple[Callable[[int], None], int]:
    """This rank's training step in ``mode`` ("owned" | "full") and the parameter bytes it holds."""
    own = ctx.ownership(DIST_MODEL["num_layers"])
    teacher = load_model(path, own, head=False) if mode == "owned" else load_model(path)
    data = _dist_data(steps)
    torch.manual_seed(0)
    student = make_student(
        teacher, StudentConfig(overrides=DIST_STUDENT), data, own if mode == "owned" else None, ctx
    )
    blocks = list(own.blocks)
    optimizers = make_optimizers(student, blocks, DIST_TCFG)
    held = materialised_bytes(teacher.module) + materialised_bytes(student.module)

    def step(k: int) -> None:
        micro = [data.batch(k * DIST_ACCUM + j) for j in range(DIST_ACCUM)]
        bypass_step(teacher, student, optimizers, blocks, micro, ctx, DIST_TCFG, 1e-4)

    return step, held


def _kl_step_fn(path: Path, steps: int) -> tuple[Callable[[int], None], int]:
    teacher = load_model(path)
    torch.manual_seed(0)
    step, student = kl_parts(teacher, _dist_data(steps), DIST_STUDENT, DIST_ACCUM)
    return step, materialised_bytes(teacher.module) + materialised_bytes(student.module)


def dist_worker(mode: str, path: Path, rank: int, world: int, port: int, report: Path, steps: int) -> None:
    """One rank of ``world`` (gloo over 127.0.0.1:``port``): writes its report as JSON to ``report``."""
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ctx = DistContext.current()
    base = _status_mib("VmRSS")
    step, held = _kl_step_fn(path, steps) if mode == "kl" else _bypass_step_fn(mode, path, ctx, steps)
    times = _timed(step, ctx, steps)
    peak = _status_mib("VmHWM")
    report.write_text(
        json.dumps(
            {
                "rank": ctx.rank,
                "base_rss_mib": base,
                "peak_rss_mib": peak,
                "model_mib": held / 2**20,
                "step_s": times,
            }
        )
    )
    if ctx.active:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(procs: Any, mode: str, world: int, path: Path, steps: int) -> list[dict[str, Any]]:
    """``world`` fresh worker processes of ``mode`` from the fork server ``procs``; every rank's report."""
    port = _free_port()
    reports = [path.parent / f"report-{mode}-{world}-{r}.json" for r in range(world)]
    workers = [
        procs.Process(target=dist_worker, args=(mode, path, r, world, port, reports[r], steps))
        for r in range(world)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=600)
    failed = [(r, w.exitcode) for r, w in enumerate(workers) if w.exitcode != 0]
    if failed:
        for w in workers:
            if w.is_alive():
                w.kill()
        raise SystemExit(f"bench_bypass: {mode} k={world}: ranks failed (rank, exit code): {failed}")
    out = [json.loads(r.read_text()) for r in reports]
    for r in reports:
        r.unlink()
    return out


def fork_server() -> Any:
    """Workers are forked from a server that has imported torch and the engine once (a fresh interpreter
    per rank would spend most of the bench importing torch on a loaded 2-core machine); each worker is
    still a new process, with its own VmHWM. At ``--small`` the server also imports ``torch._dynamo``, which
    each rank otherwise imports lazily when it builds its meta-device model (about 1.5 s of CPU per rank; the
    default run keeps the preload its committed figures were measured with)."""
    import multiprocessing

    procs = multiprocessing.get_context("forkserver")
    preload = ["torch", "composer_core.bypass.train", "safetensors.torch"]
    procs.set_forkserver_preload([*preload, *(["torch._dynamo"] if SMALL else [])])
    return procs


def _block_flops(hidden: int, heads: int, kv_heads: int, intermediate: int, seq: int) -> float:
    """Forward matmul FLOPs per token of one block: projections, causal attention ((T+1)/2 keys), SwiGLU."""
    head_dim = hidden // heads
    projections = 2 * hidden * (2 * hidden + 2 * kv_heads * head_dim)
    attention = 2 * 2 * hidden * (seq + 1) / 2
    return projections + attention + 2 * 3 * hidden * intermediate


def flop_model(worlds: Sequence[int], cores: int) -> dict[str, Any]:
    """Ideal group speedup of bypass on k ranks over KL in one process, from matmul FLOPs per token.

    Bypass, per block: teacher forward (no grad) + student forward + backward (≈ 2× forward). KL:
    every teacher and student block the same way, plus the LM head three times (teacher forward,
    student forward, student backward to its input; the head is frozen). Softmax / KL element-wise work
    is not counted. k ranks with contiguous blocks: the slowest rank holds ⌈L/k⌉ blocks, and at most
    ``cores`` ranks compute at once, so the group time is ∝ max(⌈L/k⌉, L/min(k, cores)) blocks.
    """
    m, o = DIST_MODEL, DIST_STUDENT[0]
    teacher = _block_flops(
        m["hidden_size"], m["num_heads"], m["num_kv_heads"], m["intermediate_size"], DIST_SEQ
    )
    student = _block_flops(
        m["hidden_size"], m["num_heads"], o.num_key_value_heads, o.intermediate_size, DIST_SEQ
    )
    layers, head = m["num_layers"], 2 * m["hidden_size"] * m["vocab_size"]
    per_block = teacher + 3 * student
    kl = layers * per_block + 3 * head
    ideal = {}
    for k in worlds:
        blocks = max(math.ceil(layers / k), layers / min(k, cores))
        ideal[k] = kl / (blocks * per_block)
    return {
        "teacher_block_fwd_flops_per_token": teacher,
        "student_block_fwd_flops_per_token": student,
        "lm_head_fwd_flops_per_token": head,
        "bypass_flops_per_token": layers * per_block,
        "kl_flops_per_token": kl,
        "cores": cores,
        "ideal_speedup_vs_kl": ideal,
    }


def _schedule(rounds: int) -> list[tuple[int, str, int]]:
    """(round, mode, k): every configuration once per round, the order reversed every other round."""
    configs = [(mode, k) for k in WORLDS for mode in ("owned", "full")] + [("kl", 1)]
    out = []
    for r in range(rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        out += [(r, mode, k) for mode, k in order]
    return out


def _summarise(reports: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One configuration over its rounds: per-rank peaks (median over rounds) and group tokens/s per step."""
    tokens = DIST_MB * DIST_ACCUM * DIST_SEQ
    group_steps = [max(steps) for rnd in reports for steps in zip(*(r["step_s"] for r in rnd), strict=True)]
    ranks = len(reports[0])
    peak = [statistics.median(rnd[i]["peak_rss_mib"] for rnd in reports) for i in range(ranks)]
    base = [statistics.median(rnd[i]["base_rss_mib"] for rnd in reports) for i in range(ranks)]
    return {
        "ranks": ranks,
        "peak_rss_mib_per_rank": peak,
        "base_rss_mib_per_rank": base,
        "model_mib_per_rank": [r["model_mib"] for r in reports[0]],
        "max_peak_rss_mib": max(peak),
        "max_model_mib": max(r["model_mib"] for r in reports[0]),
        "group_step_s": group_steps,
        "tokens_per_s": tokens / statistics.median(group_steps),
        "tokens_per_s_min": tokens / max(group_steps),
        "tokens_per_s_max": tokens / min(group_steps),
    }


def _dist_rows(results: dict[str, dict[str, Any]], flops: dict[str, Any]) -> list[list[Any]]:
    kl = results["kl k=1"]["tokens_per_s"]
    rows: list[list[Any]] = []
    for key, r in results.items():
        mode, k = key.split(" k=")
        speedup = r["tokens_per_s"] / kl
        ideal = flops["ideal_speedup_vs_kl"][int(k)] if mode != "kl" else 1.0
        rows.append(
            [
                "KL (one process)" if mode == "kl" else mode,
                int(k),
                round(r["max_peak_rss_mib"]),
                round(r["max_model_mib"], 1),
                f"{r['tokens_per_s']:.0f} [{r['tokens_per_s_min']:.0f}–{r['tokens_per_s_max']:.0f}]",
                round(speedup, 2),
                round(ideal, 2),
                round(speedup / ideal, 2),
            ]
        )
    return rows


DIST_COLUMNS = [
    "mode",
    "k",
    "per-rank peak RSS MiB (max)",
    "per-rank parameter MiB (max)",
    "group tokens/s [min–max]",
    "speedup vs KL",
    "ideal (FLOPs)",
    "measured / ideal",
]


def plot_dist(results: dict[str, dict[str, Any]], png: Path) -> None:
    """Per-rank peak memory and group tokens/s vs k, owned and full (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'composer-core[plot]')")
        return
    fig, (mem, tps) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("owned", "o-"), ("full", "s--")):
        rs = [results[f"{mode} k={k}"] for k in WORLDS]
        mem.plot(WORLDS, [r["max_peak_rss_mib"] for r in rs], style, label=f"{mode}: peak RSS")
        mem.plot(WORLDS, [r["max_model_mib"] for r in rs], style, alpha=0.5, label=f"{mode}: parameters")
        tps.errorbar(
            WORLDS,
            [r["tokens_per_s"] for r in rs],
            yerr=[
                [r["tokens_per_s"] - r["tokens_per_s_min"] for r in rs],
                [r["tokens_per_s_max"] - r["tokens_per_s"] for r in rs],
            ],
            fmt=style,
            capsize=3,
            label=mode,
        )
    tps.axhline(results["kl k=1"]["tokens_per_s"], color="grey", ls=":", label="KL, one process")
    mem.set(xlabel="ranks k", ylabel="MiB per rank (max over ranks)", xticks=list(WORLDS))
    tps.set(xlabel="ranks k", ylabel="group tokens/s (median, min–max)", xticks=list(WORLDS))
    mem.legend(fontsize=8)
    tps.legend(fontsize=8)
    fig.suptitle("bypass on k gloo ranks (1 thread each): owned blocks vs every rank holding everything")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(f"plot: {png}")


def distributed(rounds: int, steps: int, workdir: Path) -> None:
    load_start = list(os.getloadavg())
    path = save_sharded_teacher(workdir / "teacher")
    procs = fork_server()
    raw: dict[str, list[list[dict[str, Any]]]] = {}
    for rnd, mode, k in _schedule(rounds):
        t0 = time.perf_counter()
        raw.setdefault(f"{mode} k={k}", []).append(launch(procs, mode, k, path, steps))
        print(f"round {rnd}: {mode} k={k} done in {time.perf_counter() - t0:.1f} s", flush=True)
    keys = [f"{mode} k={k}" for mode in ("owned", "full") for k in WORLDS] + ["kl k=1"]
    results = {key: _summarise(raw[key]) for key in keys}
    flops = flop_model(WORLDS, os.cpu_count() or 1)
    rows = _dist_rows(results, flops)
    print(" | ".join(DIST_COLUMNS))
    for row in rows:
        print(" | ".join(str(c) for c in row))
    payload = {
        "model": DIST_MODEL,
        "student": [dataclasses.asdict(o) for o in DIST_STUDENT],
        "seq": DIST_SEQ,
        "micro_batch_size": DIST_MB,
        "grad_accum": DIST_ACCUM,
        "timed_steps_per_round": steps,
        "rounds": rounds,
        "small": SMALL,
        "results": results,
        "flop_model": flops,
        "machine": machine(
            1, load_average_at_start=load_start, processes_per_core=max(WORLDS) / (os.cpu_count() or 1)
        ),
        "readme": {
            "title": f"Bypass on k gloo processes (CPU, 1 thread each): {DIST_MODEL['num_layers']} blocks, hidden "
            f"{DIST_MODEL['hidden_size']}, vocab {DIST_MODEL['vocab_size']}; {DIST_ACCUM}×{DIST_MB}×{DIST_SEQ} "
            f"tokens per step; median [min–max] over {rounds} interleaved rounds × {steps} steps",
            "columns": DIST_COLUMNS,
            "rows": rows,
            "note": "owned: each rank reads only its blocks from the sharded checkpoint (the engine's default); "
            "full: every rank loads the whole teacher and builds the whole student (`hold_all_blocks=True`, the "
            "former mode). Peak RSS includes the ~fixed cost of a torch process. Ideal: KL / bypass matmul FLOPs "
            "per token for the slowest rank, at most one rank per core "
            f"({os.cpu_count()} cores here, so k = 4 cannot beat k = 2).",
        },
    }
    out = _write("bench_bypass_dist.json", payload)
    plot_dist(results, out.with_suffix(".png"))


def main() -> None:
    torch.set_num_threads(THREADS)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--memory", choices=sorted(RUNNERS))
    parser.add_argument(
        "--small", action="store_true", help="tiny models, one round: CI's check that the bench works"
    )
    parser.add_argument(
        "--rounds", type=int, default=DIST_ROUNDS, help="interleaved rounds of the distributed part"
    )
    parser.add_argument("--steps", type=int, default=DIST_STEPS, help="timed steps per distributed run")
    parser.add_argument("--part", choices=("all", "single", "dist"), default="all")
    args, ignored = parser.parse_known_args()  # `nox -s bench -- ...` passes its arguments to every script
    if ignored:
        print(f"bench_bypass: ignoring {ignored}")
    if args.memory:
        memory_child(args.memory)
    else:
        if args.part in ("all", "single"):
            single_process()
        if args.part in ("all", "dist"):
            import tempfile

            with tempfile.TemporaryDirectory(prefix="bench-bypass-") as tmp:
                distributed(args.rounds, args.steps, Path(tmp))


if __name__ == "__main__":
    main()
