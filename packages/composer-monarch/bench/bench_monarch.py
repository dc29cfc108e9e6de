"""Steps/s of the composer GRPO loop on a Monarch proc mesh: generation/training overlap vs sequential.

Both modes run on the same 2-process mesh (trainer on proc 0; generator, rewarder and teacher on
proc 1), the same number of steps, the same batch shapes, all three loss channels on. Modes alternate
(sequential, overlap, sequential, …) after one warm-up step; the median wall time per mode is reported.

    python bench_monarch.py [--steps 6] [--reps 2] [--small]

Prints the ratio and writes JSON to $COMPOSER_BENCH_OUT/bench_monarch.json (default ./bench-results),
plus a PNG when matplotlib is installed. ``--small`` is CI's check that the bench works: both modes, the
capacity probe, the JSON and the plot, on a tiny model for 2 steps (the JSON records ``"small": true``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# composer_testkit: composer-core's tests/support, never shipped (CONTRIBUTING.md, Test support)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "composer-core" / "tests" / "support"))

import torch
from composer_monarch import ComposerDriver, ComposerLoss, LoopConfig, ReplayRecord, ReverseDigits, TinyQwen2
from composer_testkit.machine import cpu_model
from monarch.actor import Actor, endpoint

SPIN_CPU_S = 0.5
"""CPU seconds each spinner burns in :func:`parallel_capacity`."""
SMALL = {"steps": 2, "reps": 1, "hidden": 32, "layers": 1, "length": 4, "prompts": 2, "group_size": 2}
"""``--small``: CI's check that the bench works (the same code paths on a tiny model, 2 steps a run)."""
SMALL_SPIN_CPU_S = 0.1


class Spinner(Actor):
    """Burns a fixed amount of CPU time: calibrates how much parallelism the machine gives 2 processes."""

    @endpoint
    def spin(self, cpu_seconds: float) -> float:
        t0, w0 = time.process_time(), time.perf_counter()
        x = 0
        while time.process_time() - t0 < cpu_seconds:
            x += 1
        return time.perf_counter() - w0


def parallel_capacity(driver: ComposerDriver, cpu_seconds: float = SPIN_CPU_S) -> float:
    """2 × (wall of one spin alone) / (wall of two spins at once, one per process): 2.0 = two free cores."""
    assert driver.procs is not None
    a = driver.procs.slice(procs=0).spawn("spin0", Spinner)
    b = driver.procs.slice(procs=1).spawn("spin1", Spinner)
    a.spin.call_one(0.01).get(timeout=60)
    b.spin.call_one(0.01).get(timeout=60)
    t0 = time.perf_counter()
    a.spin.call_one(cpu_seconds).get(timeout=600)
    alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    fa, fb = a.spin.call_one(cpu_seconds), b.spin.call_one(cpu_seconds)
    fa.get(timeout=600)
    fb.get(timeout=600)
    both = time.perf_counter() - t0
    return 2 * alone / both


def _readme(
    args: argparse.Namespace,
    timings: dict[str, list[float]],
    sps: dict[str, float],
    phase: dict[str, float],
    ideal: float,
    capacity: float,
) -> dict[str, Any]:
    """The JSON's "readme" block (CONTEXT: bench JSON): one row per mode."""
    return {
        "title": f"composer-monarch loop, overlap vs sequential: {args.steps} steps × {args.prompts}×"
        f"{args.group_size} completions, Qwen2 hidden {args.hidden} × {args.layers} layers, median of "
        f"{args.reps} runs",
        "columns": ["mode", "median s / run", "min s", "max s", "steps/s", "vs sequential"],
        "rows": [
            [
                mode,
                round(statistics.median(ts), 3),
                round(min(ts), 3),
                round(max(ts), 3),
                round(sps[mode], 3),
                round(sps[mode] / sps["sequential"], 3),
            ]
            for mode, ts in timings.items()
        ],
        "note": f"sequential phases (median s): train {phase['train_wait_s']:.3f}, push {phase['push_s']:.3f}, "
        f"rollout {phase['rollout_s']:.3f}; ideal overlap ratio {ideal:.2f}x, parallel capacity for 2 "
        f"processes {capacity:.2f} (overlap cannot beat the smaller).",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per timed run")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per mode (median)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--length", type=int, default=12, help="digits per prompt (completion = length + 1)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument(
        "--small", action="store_true", help="tiny sizes, one rep: CI's check that the bench works"
    )
    args = ap.parse_args()
    if args.small:
        for name, value in SMALL.items():
            setattr(args, name, value)

    task = ReverseDigits(n_digits=8, length=args.length)
    model = TinyQwen2(
        task.vocab_size, hidden_size=args.hidden, num_layers=args.layers, intermediate_size=4 * args.hidden
    )
    horizon = 1 + (1 + args.reps * 2) * args.steps + 2
    replay = [
        ReplayRecord(p, task.target(p), 1.0, "oracle")
        for s in range(horizon)
        for p in task.prompts(args.prompts, step=s)
    ]
    loss = ComposerLoss(loss_type="grpo", alpha_sdpo=0.5, beta_replay=0.5)
    loop = LoopConfig(prompts_per_step=args.prompts, group_size=args.group_size, procs=2, num_threads=1)

    timings: dict[str, list[float]] = {"sequential": [], "overlap": []}
    phases: dict[str, list[float]] = {"train_wait_s": [], "push_s": [], "rollout_s": []}
    t_start = time.perf_counter()
    with ComposerDriver(task, model, loss=loss, loop=loop, replay=replay) as driver:
        startup = time.perf_counter() - t_start
        driver.run(steps=1, overlap=False, progress=False)  # warm-up
        capacity = parallel_capacity(driver, SMALL_SPIN_CPU_S if args.small else SPIN_CPU_S)
        for rep in range(args.reps):
            for mode in ("sequential", "overlap"):
                t0 = time.perf_counter()
                results = driver.run(steps=args.steps, overlap=(mode == "overlap"), progress=False)
                timings[mode].append(time.perf_counter() - t0)
                if mode == "sequential":  # phases are separable only when nothing overlaps
                    for r in results[:-1]:
                        for key in phases:
                            phases[key].append(r.extra[key])
                print(f"rep {rep} {mode:>10}: {args.steps / timings[mode][-1]:.3f} steps/s")

    sps = {m: args.steps / statistics.median(ts) for m, ts in timings.items()}
    ratio = sps["overlap"] / sps["sequential"]
    phase = {k: statistics.median(v) for k, v in phases.items()}
    # perfect overlap hides the shorter of training and rollout (on ≥ 2 free cores)
    ideal = sum(phase.values()) / (max(phase["train_wait_s"], phase["rollout_s"]) + phase["push_s"])
    print(
        f"composer-monarch loop, {args.steps} steps × {args.prompts}×{args.group_size} completions, "
        f"Qwen2 hidden {args.hidden} × {args.layers} layers, cores={os.cpu_count()}:\n"
        f"  sequential {sps['sequential']:.3f} steps/s | overlap {sps['overlap']:.3f} steps/s | "
        f"overlap / sequential = {ratio:.2f}x\n"
        f"  sequential phases (median s): train {phase['train_wait_s']:.3f}, push {phase['push_s']:.3f}, "
        f"rollout {phase['rollout_s']:.3f} → ideal overlap ratio {ideal:.2f}x; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n"
        f"  parallel capacity for 2 processes: {capacity:.2f} (2.00 = two free cores; overlap cannot beat "
        f"min(ideal, capacity) = {min(ideal, capacity):.2f}x)"
    )
    out = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "composer-monarch overlap vs sequential",
        "steps_per_run": args.steps,
        "reps": args.reps,
        "small": args.small,
        "batch": {
            "prompts": args.prompts,
            "group_size": args.group_size,
            "completion_tokens": args.length + 1,
        },
        "model": {"hidden": args.hidden, "layers": args.layers},
        "cpu_count": os.cpu_count(),
        "startup_s": startup,
        "seconds": timings,
        "steps_per_s": sps,
        "ratio_overlap_over_sequential": ratio,
        "sequential_phase_median_s": phase,
        "ideal_ratio_from_phases": ideal,
        "load_average_1min": os.getloadavg()[0],
        "parallel_capacity_2_procs": capacity,
        "achievable_bound": min(ideal, capacity),
        "machine": {
            "processor": cpu_model(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "threads": 1,
            "load_average_at_end": os.getloadavg(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "readme": _readme(args, timings, sps, phase, ideal, capacity),
    }
    (out / "bench_monarch.json").write_text(json.dumps(record, indent=2))
    plot(record, out)


def plot(record: dict[str, Any], out: Path) -> None:
    """steps/s per mode, with the bound overlap can reach (min(ideal, capacity) × sequential), as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {out / 'bench_monarch.json'} (install matplotlib for a plot)")
        return
    sps = record["steps_per_s"]
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    ax.bar(list(sps), list(sps.values()), color=["tab:gray", "tab:blue"])
    bound = record["achievable_bound"] * sps["sequential"]
    ax.axhline(bound, color="r", lw=0.8, ls="--")
    label = f"bound min(ideal, capacity) = {record['achievable_bound']:.2f}x"
    ax.annotate(label, (-0.4, bound), fontsize=7, color="r", va="bottom")
    ax.set_ylabel("steps / s")
    ax.set_title(f"overlap / sequential = {record['ratio_overlap_over_sequential']:.2f}x")
    fig.tight_layout()
    fig.savefig(out / "bench_monarch.png", dpi=120)
    print(f"wrote {out / 'bench_monarch.json'} and {out / 'bench_monarch.png'}")


if __name__ == "__main__":
    main()
