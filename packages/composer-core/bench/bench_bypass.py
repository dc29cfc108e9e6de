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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from composer_core.bypass import (
    BlockOverride,
    ReferenceConfig,
    ReferenceDecoder,
    TrainingConfig,
    build_student,
)
from composer_core.bypass.data import TokenBatches, synthetic_tokens
from composer_core.bypass.distributed import DistContext
from composer_core.bypass.keys import freeze_for_training
from composer_core.bypass.train import bypass_step, make_optimizers

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
    student = build_student(teacher, STUDENT)
    params = [
        p
        for ps in freeze_for_training(student, range(student.num_blocks), ("entire_block",)).values()
        for p in ps
    ]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=TCFG.betas, fused=True)

    def step(k: int) -> None:
        batch = data.batch(k)
        with torch.no_grad():
            t_logp = F.log_softmax(teacher(batch).float(), -1)
        s_logp = F.log_softmax(student(batch).float(), -1)  # type: ignore[operator]
        F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean").backward()  # KL(teacher‖student)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


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


def main() -> None:
    torch.set_num_threads(THREADS)
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory", choices=sorted(RUNNERS))
    args = parser.parse_args()
    if args.memory:
        memory_child(args.memory)
        return
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
        proc = subprocess.run(
            [sys.executable, __file__, "--memory", m], capture_output=True, text=True, check=True
        )
        results[m] = {
            "median_step_s": med,
            "tokens_per_s": tokens / med,
            "median_step_cpu_s": med_cpu,
            "tokens_per_cpu_s": tokens / med_cpu,
            **json.loads(proc.stdout.splitlines()[-1]),
        }
    cpu_ratio = results["bypass"]["tokens_per_cpu_s"] / results["kl"]["tokens_per_cpu_s"]
    ratio = results["bypass"]["tokens_per_s"] / results["kl"]["tokens_per_s"]
    mem = results["bypass"]["training_peak_growth_mib"] / max(results["kl"]["training_peak_growth_mib"], 1e-9)
    print(
        f"model {MODEL}; student FFN 1024, KV heads 4; batch {BATCH}x{SEQ}; {STEPS} timed steps each, alternating"
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
    out = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": MODEL,
        "batch": BATCH,
        "seq": SEQ,
        "steps": STEPS,
        "results": results,
        "tokens_per_s_ratio": ratio,
        "tokens_per_cpu_s_ratio": cpu_ratio,
        "memory_growth_ratio": mem,
        "torch_threads": torch.get_num_threads(),
    }
    (out / "bench_bypass.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
