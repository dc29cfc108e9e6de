"""Weight push trainer → generator + teacher on a Monarch proc mesh: today's path vs the new one.

* ``driver-pickle`` (the path before issue 19): the driver asks the trainer for its state dict
  (pickled), then sends it to the generator and the teacher (pickled again, twice).
* ``rdma``: the trainer packs its weights into one registered buffer and the generator and teacher
  read it with Monarch's ``RDMABuffer`` (ibverbs where present, Monarch's TCP transport on CPU hosts).
* ``direct``: the trainer sends the packed buffer in one message to each of them.
* ``shm``: the packed buffer lives in shared memory; the receivers (on the trainer's host) copy out of it.
  This is what ``weight_transport="auto"`` picks when all actors share a host.

The model is a Qwen2 of about ``--params-m`` million fp32 parameters (125 by default); trainer on proc 0,
generator and teacher on proc 1. The three methods are interleaved for ``--reps`` rounds after one
warm-up push each; every push is checked bit-exact on both receivers. Reports the median seconds per
push, the spread (min–max) and MiB/s, and writes ``$COMPOSER_BENCH_OUT/bench_monarch_push.json``.
``--small`` is CI's check that the bench works: every method, bit-exact checks included, on a Qwen2 of about
0.25M parameters, one round (the JSON records ``"small": true``).

    python bench_monarch_push.py [--params-m 125] [--reps 3] [--small]
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
from composer_monarch import ComposerDriver, ComposerLoss, LoopConfig, ReverseDigits, TinyQwen2
from composer_testkit.machine import cpu_model

METHODS = ("driver-pickle", "shm", "rdma", "direct")
SHAPE = {"hidden": 768, "intermediate": 2048, "heads": 12}
"""The layer shape of the pushed Qwen2 (hidden 768: GPT-2 small's width); ``--params-m`` sets the depth."""
SMALL = {"params_m": 0.25, "vocab": 512, "reps": 1}
"""``--small``: CI's check that the bench works (every method on a tiny model, one round)."""
SMALL_SHAPE = {"hidden": 64, "intermediate": 128, "heads": 4}


def model_of(params_m: float, vocab: int, shape: dict[str, int] = SHAPE) -> TinyQwen2:
    """A Qwen2 of layer shape ``shape`` with as many layers as fit ``params_m`` million parameters."""
    hidden, inter, heads = shape["hidden"], shape["intermediate"], shape["heads"]
    embed = 2 * vocab * hidden
    per_layer = 4 * hidden * hidden + 3 * hidden * inter
    layers = max(1, round((params_m * 1e6 - embed) / per_layer))
    return TinyQwen2(vocab, hidden, layers, heads, heads, inter, max_positions=64)


def old_push(d: ComposerDriver) -> None:
    """Today's path before the change: trainer → driver → generator, teacher (pickled state dict)."""
    version, state = d._call("trainer", "weights")()
    done = [d._call(r, "update_weights", version, state) for r in ("generator", "teacher")]
    for f in done:
        f()


def new_push(d: ComposerDriver, transport: str) -> None:
    d._call("trainer", "connect", {r: d.actors[r] for r in ("generator", "teacher")}, transport, 600.0)()
    d._push_weights()


def checksum_all(d: ComposerDriver) -> None:
    """Every receiver's weights equal the trainer's, bit for bit (checked outside the timed region)."""
    trainer = d.weights()
    for role in ("generator", "teacher"):
        _, got = d._call(role, "weights")()
        bad = [k for k in trainer if not torch.equal(trainer[k], got[k])]
        if bad:
            raise SystemExit(f"{role} differs from the trainer after the push: {bad[:3]}")


def perturb(d: ComposerDriver, seed: int) -> None:
    """New trainer weights so each push moves different bytes."""
    state = d._call("trainer", "state")()
    g = torch.Generator().manual_seed(seed)
    state["model"] = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in state["model"].items()}
    d._call("trainer", "load_state", state)()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-m", type=float, default=125.0, help="model size in millions of parameters")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds (median, spread)")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True, help="bit-exact check")
    ap.add_argument(
        "--small", action="store_true", help="a tiny model, one round: CI's check that the bench works"
    )
    args = ap.parse_args()
    if args.small:
        for name, value in SMALL.items():
            setattr(args, name, value)

    task = ReverseDigits(n_digits=8, length=3)
    model = model_of(args.params_m, args.vocab, SMALL_SHAPE if args.small else SHAPE)
    loss = ComposerLoss(loss_type="grpo", alpha_sdpo=0.5, beta_replay=0.0)
    loop = LoopConfig(procs=2, num_threads=1, call_timeout_s=600, start_timeout_s=1200)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    with ComposerDriver(task, model, loss=loss, loop=loop) as d:
        params = sum(t.numel() for t in d.weights().values())
        nbytes = int(d.last_push["bytes"])
        for m in METHODS:  # warm-up: registration, receive buffers
            old_push(d) if m == "driver-pickle" else new_push(d, m)
        for rep in range(args.reps):
            for m in METHODS:
                if args.check:  # new bytes each push, checked after it (slow: the weights pass the driver)
                    perturb(d, rep * 10 + METHODS.index(m))
                if m != "driver-pickle":
                    d._call(
                        "trainer", "connect", {r: d.actors[r] for r in ("generator", "teacher")}, m, 600.0
                    )()
                t0 = time.perf_counter()
                old_push(d) if m == "driver-pickle" else d._push_weights()
                times[m].append(time.perf_counter() - t0)
                if args.check:
                    checksum_all(d)
                print(f"rep {rep} {m:>13}: {times[m][-1]:.2f} s")
        backend = d._call(
            "trainer", "connect", {r: d.actors[r] for r in ("generator", "teacher")}, "auto", 600.0
        )()
    med = {m: statistics.median(v) for m, v in times.items()}
    speedup = {m: med["driver-pickle"] / med[m] for m in METHODS}
    mib = nbytes / 2**20
    print(
        f"push of {params / 1e6:.3g}M params ({mib:.0f} MiB) to generator + teacher, median of {args.reps}:"
    )
    for m in METHODS:
        print(
            f"  {m:>13}: {med[m]:6.2f} s (spread {min(times[m]):.2f}–{max(times[m]):.2f}) "
            f"{2 * mib / med[m]:7.0f} MiB/s delivered, {speedup[m]:.1f}x today's"
        )
    record: dict[str, Any] = {
        "benchmark": "composer-monarch weight push trainer -> generator + teacher",
        "target": "new push >= 5x faster than the driver-pickle path at 125M params",
        "params": params,
        "bytes_per_receiver": nbytes,
        "reps": args.reps,
        "small": args.small,
        "checked_bit_exact": args.check,
        "auto_transport_here": backend,
        "seconds": times,
        "median_s": med,
        "speedup_vs_driver_pickle": speedup,
        "machine": {
            "platform": platform.platform(),
            "processor": cpu_model(),
            "cpu_count": os.cpu_count(),
            "threads": 1,
            "load_average_at_end": os.getloadavg(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "readme": {
            "title": f"Weight push of {params / 1e6:.3g}M fp32 params to generator + teacher (median of {args.reps})",
            "columns": ["path", "median s", "min s", "max s", "MiB/s delivered", "speed-up vs driver-pickle"],
            "rows": [
                [
                    m,
                    round(med[m], 2),
                    round(min(times[m]), 2),
                    round(max(times[m]), 2),
                    round(2 * mib / med[m]),
                    round(speedup[m], 2),
                ]
                for m in METHODS
            ],
        },
    }
    out = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_monarch_push.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out / 'bench_monarch_push.json'}")


if __name__ == "__main__":
    main()
