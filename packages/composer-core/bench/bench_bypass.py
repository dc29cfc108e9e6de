"""Bypass (blockwise) distillation vs full-model logit distillation (KL) of the same student, CPU.

Both train the same pruned student (FFN halved, KV heads halved) from the same teacher on the
same token batches, with AdamW over the same block parameters (embeddings and LM head frozen):

* bypass: the real engine (``run_bypass``): one no-grad teacher forward per micro-batch
  without the LM head, then every student block trained on the teacher's block input with
  normalised MSE. Timed as the difference of a long and a short run (build/save excluded).
* KL: teacher logits (no grad), student full forward to logits, forward KL(teacher‖student)
  over the vocabulary, backward through the whole student.

Each method runs in its own process so peak memory (``ru_maxrss`` growth during training)
is its own. Prints tokens/s, peak memory and the ratio; writes JSON to $COMPOSER_BENCH_OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from composer_core.bypass import BlockOverride, ReferenceConfig, ReferenceDecoder, build_student, config_from_dict, run_bypass
from composer_core.bypass.data import TokenBatches, synthetic_tokens
from composer_core.bypass.keys import freeze_for_training

MODEL = dict(vocab_size=16384, hidden_size=384, num_layers=4, num_heads=8, num_kv_heads=8, intermediate_size=1536)
STUDENT = [BlockOverride(intermediate_size=768, num_key_value_heads=4)]
SEQ, BATCH, WARM, STEPS = 256, 4, 2, 8


def _setup() -> tuple[ReferenceDecoder, torch.Tensor]:
    torch.manual_seed(0)
    teacher = ReferenceDecoder(ReferenceConfig(**MODEL)).eval()  # type: ignore[arg-type]
    return teacher, synthetic_tokens(MODEL["vocab_size"], 64, SEQ, seed=1)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_bypass(teacher: ReferenceDecoder, ids: torch.Tensor) -> float:
    out = tempfile.mkdtemp(prefix="bench-bypass-")

    def run(steps: int) -> float:
        cfg = config_from_dict({
            "student": {"overrides": [{"intermediate_size": 768, "num_key_value_heads": 4}]},
            "training": {"steps": steps, "micro_batch_size": BATCH, "lr": 1e-4},
            "run": {"output_dir": out, "name": f"s{steps}"},
        })
        t0 = time.perf_counter()
        run_bypass(teacher, ids, cfg, resume=False, progress=False)
        return time.perf_counter() - t0

    short = run(WARM)
    long = run(WARM + STEPS)
    return long - short


def bench_kl(teacher: ReferenceDecoder, ids: torch.Tensor) -> float:
    student = build_student(teacher, STUDENT)
    params = [p for ps in freeze_for_training(student, range(student.num_blocks), ("entire_block",)).values() for p in ps]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    data = TokenBatches(ids, micro_batch_size=BATCH, seed=0)

    def step(k: int) -> None:
        batch = data.batch(k)
        with torch.no_grad():
            t_logp = F.log_softmax(teacher(batch).float(), -1)
        s_logp = F.log_softmax(student(batch).float(), -1)  # type: ignore[operator]
        loss = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")  # KL(teacher‖student)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for k in range(WARM):
        step(k)
    t0 = time.perf_counter()
    for k in range(WARM, WARM + STEPS):
        step(k)
    return time.perf_counter() - t0


def child(method: str) -> None:
    teacher, ids = _setup()
    base = _rss_mib()
    seconds = (bench_bypass if method == "bypass" else bench_kl)(teacher, ids)
    tokens = STEPS * BATCH * SEQ
    print(json.dumps({"method": method, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                      "peak_rss_mib": _rss_mib(), "training_peak_growth_mib": _rss_mib() - base}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=["bypass", "kl"])
    args = parser.parse_args()
    if args.method:
        child(args.method)
        return
    results = {}
    for method in ("bypass", "kl"):
        proc = subprocess.run([sys.executable, __file__, "--method", method], capture_output=True, text=True, check=True)
        results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
    ratio = results["bypass"]["tokens_per_s"] / results["kl"]["tokens_per_s"]
    mem = results["bypass"]["training_peak_growth_mib"] / max(results["kl"]["training_peak_growth_mib"], 1e-9)
    print(f"model {MODEL}, student {STUDENT[0]}, batch {BATCH}x{SEQ}, {STEPS} timed steps, torch threads "
          f"{torch.get_num_threads()}")
    print(f"{'method':>8} {'tokens/s':>10} {'peak RSS MiB':>13} {'train growth MiB':>17}")
    for m, r in results.items():
        print(f"{m:>8} {r['tokens_per_s']:10.0f} {r['peak_rss_mib']:13.0f} {r['training_peak_growth_mib']:17.0f}")
    print(f"bypass / KL tokens/s ratio: {ratio:.2f}x (target >= 2x); training memory growth ratio: {mem:.2f}")
    out = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_bypass.json").write_text(json.dumps(
        {"model": MODEL, "batch": BATCH, "seq": SEQ, "steps": STEPS, "results": results,
         "tokens_per_s_ratio": ratio, "memory_growth_ratio": mem}, indent=1))


if __name__ == "__main__":
    main()
