"""Per-step cost of ``composer_loss`` in PRIME-RL's per-sample loop, side by side with an
inline plain-torch DPPO + KL loss (PRIME-RL's default formula, no validation).

One "step" = PRIME-RL's ``compute_loss`` pattern: call the loss once per packed sample, sum,
divide by the token count, backward. composer_loss validates every sample (NaN/inf, shapes,
empty mask) in one device sync plus composer_core's own checks; this measures what that
costs. Prints the ratios and writes JSON to $COMPOSER_BENCH_OUT (default ./bench-results).

    python bench/bench_composer_loss.py [--samples 32] [--lengths 256,4096] [--repeats 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from composer_prime_rl import LossInputs, LossOutputs, composer_loss


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


def timed(
    fn: Callable[..., LossOutputs],
    samples: list[dict[str, torch.Tensor]],
    kwargs: dict[str, Any],
    repeats: int,
) -> float:
    sync = torch.cuda.synchronize if samples[0]["lp"].is_cuda else (lambda: None)
    step(fn, samples, kwargs)  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        step(fn, samples, kwargs)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32, help="packed samples per micro-batch")
    parser.add_argument("--lengths", default="256,4096", help="tokens per sample, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: per-sample tensors are small; "
        "more threads only add contention on a shared machine)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    results = []
    for device in devices:
        for length in (int(x) for x in args.lengths.split(",")):
            samples = make_samples(args.samples, length, device)
            base = timed(inline_dppo_kl, samples, {}, args.repeats)
            rows = {
                "composer_dppo": timed(composer_loss, samples, {}, args.repeats),
                "composer_clipped_surrogate_sdpo": timed(
                    composer_loss,
                    samples,
                    {"policy_loss": "clipped_surrogate", "alpha_sdpo": 1.0},
                    args.repeats,
                ),
            }
            for name, ms in rows.items():
                print(
                    f"[{device.type}, {args.samples} x {length} tokens] {name}: {ms:.2f} ms/step vs inline "
                    f"DPPO+KL {base:.2f} ms/step -> ratio {ms / base:.2f}x"
                )
            results.append(
                {
                    "device": device.type,
                    "samples": args.samples,
                    "length": length,
                    "repeats": args.repeats,
                    "cpu_threads": args.threads,
                    "inline_dppo_kl_ms": base,
                    **{f"{k}_ms": v for k, v in rows.items()},
                    **{f"{k}_ratio": v / base for k, v in rows.items()},
                }
            )
    out = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "prime_rl_composer_loss.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
