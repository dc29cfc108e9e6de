"""Per-step cost of ``composer_loss`` in PRIME-RL's per-sample loop, side by side with an
inline plain-torch DPPO + KL loss (PRIME-RL's default formula, no validation, one metric) and, when a
PRIME-RL checkout is given (``--prime-rl-src`` / ``$PRIME_RL_SRC``) or ``prime_rl`` is importable,
PRIME-RL's own ``default_loss_fn`` (the same formula with its seven metrics: the information-matched anchor,
since composer_loss returns the same seven).

One "step" = PRIME-RL's ``compute_loss`` pattern: call the loss once per packed sample, sum,
divide by the token count, backward. composer_loss validates every sample (NaN/inf, shapes,
empty mask) in one device sync plus composer_core's own checks; this measures what that
costs. Prints the ratios and writes JSON to $COMPOSER_BENCH_OUT (default ./bench-results).

    python bench/bench_composer_loss.py [--samples 32] [--lengths 256,4096] [--repeats 15] [--threads 1]
                                        [--prime-rl-src PATH]

Besides wall time (noisy on a shared machine) it counts the aten operators one sample's forward + backward
dispatches per method: a load-independent measure of the per-call overhead that dominates small samples.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from composer_core.testing.machine import cpu_model
from composer_prime_rl import LossInputs, LossOutputs, composer_loss
from composer_prime_rl.upstream import UpstreamUnavailable, load_upstream
from torch.utils._python_dispatch import TorchDispatchMode


def inline_dppo_kl(
    inputs: Any, mask_low: float = 0.2, mask_high: float = 0.2, kl_tau: float = 1e-3
) -> LossOutputs:
    """The DPPO + KL formula written directly (no validation, no metrics beyond one)."""
    log_ratio = inputs.trainer_logprobs - inputs.inference_logprobs
    dp = torch.exp(inputs.trainer_logprobs) - torch.exp(inputs.inference_logprobs)
    adv = inputs.advantages
    masked = torch.where(adv > 0, dp > mask_high, dp < -mask_low)
    keep = inputs.loss_mask & ~masked
    per_token = -(keep * adv * torch.exp(log_ratio)) + kl_tau * inputs.loss_mask * log_ratio**2
    return LossOutputs(loss=per_token.sum(), metrics={"is_masked": masked.float().mean()})


def make_samples(n: int, length: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(n):
        p_inf = torch.rand(length, generator=g) * 0.9 + 0.05
        p_train = (p_inf + (torch.rand(length, generator=g) - 0.5) * 0.4).clamp(0.01, 0.99)
        samples.append(
            {
                "lp": p_train.log().to(device),
                "inf": p_inf.log().to(device),
                "ref": (torch.rand(length, generator=g) * 0.9 + 0.05).log().to(device),
                "adv": torch.randn(1, generator=g).expand(length).clone().to(device),
                "mask": (torch.rand(length, generator=g) > 0.1).to(device),
            }
        )
    return samples


def step(
    fn: Callable[..., LossOutputs], samples: list[dict[str, torch.Tensor]], kwargs: dict[str, Any]
) -> None:
    leaves = [s["lp"].clone().requires_grad_(True) for s in samples]
    total = leaves[0].sum() * 0.0
    count = 0
    for s, lp in zip(samples, leaves, strict=True):
        inputs = LossInputs(lp, s["inf"], s["ref"], s["adv"], s["mask"])
        total = total + fn(inputs, **kwargs).loss
        count += s["mask"].shape[0]
    (total / count).backward()


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def op_count(fn: Callable[..., LossOutputs], sample: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> int:
    """aten operators dispatched by one sample's loss forward + backward (metrics included)."""
    lp = sample["lp"].clone().requires_grad_(True)
    inputs = LossInputs(lp, sample["inf"], sample["ref"], sample["adv"], sample["mask"])
    with _OpCounter() as counter:
        fn(inputs, **kwargs).loss.backward()
    return counter.count


def prime_rl_default(src: str | None) -> Callable[..., LossOutputs] | None:
    """PRIME-RL's own ``default_loss_fn`` with its default config (None, with a note, when unavailable)."""
    try:
        loss_mod, configs = load_upstream(src)
    except UpstreamUnavailable as exc:
        print(f"note: PRIME-RL's default_loss_fn is not measured: {exc}")
        return None
    cfg = configs.DefaultLossConfig()

    def default_loss_fn(inputs: Any) -> LossOutputs:
        return loss_mod.default_loss_fn(inputs, cfg)  # type: ignore[no-any-return]

    return default_loss_fn


def interleaved(
    methods: dict[str, tuple[Callable[..., LossOutputs], dict[str, Any]]],
    samples: list[dict[str, torch.Tensor]],
    repeats: int,
) -> dict[str, list[float]]:
    """ms per step of every method, interleaved (one step of each per repeat, order rotating). On CPU the
    clock is this process's CPU time (``time.process_time``; 1 torch thread): on a shared machine the wall
    clock also counts other jobs' time slices, which swings side-by-side ratios by 10x under load. On CUDA it
    is the wall clock around synchronized steps."""
    cuda = samples[0]["lp"].is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.perf_counter if cuda else time.process_time
    names = list(methods)
    for fn, kwargs in methods.values():
        step(fn, samples, kwargs)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, kwargs = methods[name]
            sync()
            t0 = clock()
            step(fn, samples, kwargs)
            sync()
            times[name].append((clock() - t0) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32, help="packed samples per micro-batch")
    parser.add_argument("--lengths", default="256,4096", help="tokens per sample, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--small", action="store_true", help="CI's check that the bench works (tiny sizes)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: per-sample tensors are small; "
        "more threads only add contention on a shared machine)",
    )
    parser.add_argument("--prime-rl-src", default=None, help="a prime-rl checkout (default: $PRIME_RL_SRC)")
    args = parser.parse_args()
    if args.small:
        args.samples, args.lengths, args.repeats = 4, "64", 3
    if args.threads != 1:
        parser.error("--threads: the CPU clock is process time, which sums threads; keep --threads 1")
    torch.set_num_threads(args.threads)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    upstream = prime_rl_default(args.prime_rl_src)
    methods: dict[str, tuple[Callable[..., LossOutputs], dict[str, Any]]] = {
        "inline_dppo_kl": (inline_dppo_kl, {}),
        **({"prime_rl_default_loss_fn": (upstream, {})} if upstream else {}),
        "composer_dppo": (composer_loss, {}),
        "composer_clipped_surrogate_sdpo": (
            composer_loss,
            {"policy_loss": "clipped_surrogate", "alpha_sdpo": 1.0},
        ),
    }
    anchors = ["inline_dppo_kl", *(["prime_rl_default_loss_fn"] if upstream else [])]
    results, table = [], []
    for device in devices:
        for length in (int(x) for x in args.lengths.split(",")):
            samples = make_samples(args.samples, length, device)
            times = interleaved(methods, samples, args.repeats)
            ops = {name: op_count(fn, samples[0], kw) for name, (fn, kw) in methods.items()}
            row: dict[str, Any] = {
                "device": device.type, "samples": args.samples, "length": length, "repeats": args.repeats,
                "cpu_threads": args.threads, "times_ms": times, "ops_per_sample": ops,
            }  # fmt: skip
            for name in methods:
                row[f"{name}_ms"] = statistics.median(times[name])
                row[f"{name}_spread_ms"] = [min(times[name]), max(times[name])]
                cells = []
                for anchor in anchors:
                    if name == anchor or (anchor != "inline_dppo_kl" and name in anchors):
                        cells.append("—")
                        continue
                    # ratio per interleaved repeat (side by side), then its median and range
                    per = [a / b for a, b in zip(times[name], times[anchor], strict=True)]
                    row[f"{name}_ratio_vs_{anchor}"] = statistics.median(per)
                    row[f"{name}_ratio_vs_{anchor}_spread"] = [min(per), max(per)]
                    cells.append(f"{statistics.median(per):.2f} [{min(per):.2f}–{max(per):.2f}]")
                    print(
                        f"[{device.type}, {args.samples} x {length} tokens] {name}: {row[f'{name}_ms']:.2f} ms/step, "
                        f"{ops[name]} ops/sample vs {anchor} {statistics.median(times[anchor]):.2f} ms/step, "
                        f"{ops[anchor]} ops/sample -> {statistics.median(per):.2f}x [{min(per):.2f}-{max(per):.2f}]"
                    )
                table.append(
                    [device.type, f"{args.samples} × {length}", name.removeprefix("composer_"),
                     f"{row[f'{name}_ms']:.1f}", ops[name], *cells]
                )  # fmt: skip
            results.append(row)
    out = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_composer_loss.json"
    doc = {
        "benchmark": "composer_prime_rl.composer_loss per PRIME-RL step vs an inline DPPO+KL formula and PRIME-RL's "
        "default_loss_fn",
        "target": "ratio <= 1.3",
        "machine": {
            "processor": cpu_model(),
            "cpu_count": os.cpu_count(),
            "threads": args.threads,
            "load_average": os.getloadavg(),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__,
        },
        "rows": results,
        "readme": {
            "title": f"composer_loss per step (PRIME-RL's per-sample loop, forward + backward) vs the inline "
            f"DPPO+KL formula (one metric) and PRIME-RL's own default_loss_fn (its seven metrics, as composer's): "
            f"median of {args.repeats} interleaved repeats [ratio range], CPU time of the process on CPU; ops = aten "
            f"operators per sample (forward + backward)",
            "columns": [
                "device",
                "samples × tokens",
                "method",
                "ms / step",
                "ops / sample",
                *(f"ratio vs {a.removesuffix('_dppo_kl').replace('_loss_fn', '')}" for a in anchors),
            ],
            "rows": table,
        },
    }
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
