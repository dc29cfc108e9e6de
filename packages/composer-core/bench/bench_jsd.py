"""Benchmark: chunked / fused-linear generalized JSD vs a naive implementation, side by side.

Forward + backward of the generalized JSD (β = 0.5) on the same inputs:

- ``fused``: :func:`composer_core.fused_linear_generalized_jsd` from hidden states [N, H] and an LM head
  [V, H]; logits exist only ``chunk × V`` at a time.
- ``naive``: ``logits = hidden @ Wᵀ`` for student and teacher, full ``log_softmax`` [N, V] and the TRL GKD
  formula with autograd (``composer_core.testing.reference.naive_jsd``): what a plain implementation does.
- ``chunked`` vs ``naive_logits`` (with ``--logits``): the logits-input form, where the [N, V] inputs and
  their gradient are part of both peaks, so only the intermediates shrink.

Peak memory is measured honestly on CPU: every (method, size) runs in a fresh subprocess; the reported peak
is the process's peak resident set (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) minus its resident set
just before the first forward pass (inputs already allocated). Python's tracemalloc does not see torch's
allocations, so it is not used. Time is the median of ``--repeats`` forward+backward passes after that
first (cold) pass. Results are printed and written to ``$COMPOSER_BENCH_OUT/bench_jsd.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_SIZES = [(32_000, 4096), (152_064, 1024)]  # (V, N tokens); naive peak ≈ 7 GB and 8.5 GB


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _child(
    method: str, vocab: int, tokens: int, hidden: int, chunk: int, repeats: int, threads: int
) -> dict[str, Any]:
    import torch
    from composer_core import fused_linear_generalized_jsd, generalized_jsd
    from composer_core.testing.reference import naive_jsd

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    if method in ("fused", "naive"):
        h_s = (torch.randn(tokens, hidden, generator=g) * 0.5).requires_grad_(True)
        h_t = torch.randn(tokens, hidden, generator=g) * 0.5
        w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).requires_grad_(True)
        params = [h_s, w]

        def step() -> float:
            if method == "fused":
                loss = fused_linear_generalized_jsd(h_s, w, h_t, beta=0.5, chunk_size=chunk)
            else:
                logits_s = h_s @ w.T
                with torch.no_grad():
                    logits_t = h_t @ w.T
                loss = naive_jsd(logits_s, logits_t, 0.5).mean()
            loss.backward()
            return float(loss)

    else:
        z_s = (torch.randn(tokens, vocab, generator=g) * 2).requires_grad_(True)
        z_t = torch.randn(tokens, vocab, generator=g) * 2
        params = [z_s]

        def step() -> float:
            if method == "chunked":
                loss = generalized_jsd(z_s, z_t, beta=0.5, chunk_size=chunk)
            else:
                loss = naive_jsd(z_s, z_t, 0.5).mean()
            loss.backward()
            return float(loss)

    base = _rss_bytes()
    t0 = time.perf_counter()
    value = step()
    cold = time.perf_counter() - t0
    peak = _maxrss_bytes() - base
    grad_norm = float(sum(float(p.grad.double().norm() ** 2) for p in params if p.grad is not None) ** 0.5)
    times = []
    for _ in range(repeats):
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {
        "method": method,
        "vocab": vocab,
        "tokens": tokens,
        "hidden": hidden,
        "chunk_size": chunk,
        "loss": value,
        "grad_norm": grad_norm,
        "peak_bytes": peak,
        "cold_s": cold,
        "time_s": statistics.median(times) if times else cold,
        "times_s": times,
    }


def _run(method: str, vocab: int, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        method,
        "--sizes",
        f"{vocab}x{tokens}",
        "--hidden",
        str(args.hidden),
        "--chunk-size",
        str(args.chunk_size),
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:8.0f} MiB"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sizes", default=",".join(f"{v}x{n}" for v, n in DEFAULT_SIZES), help="VxN,VxN,...")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--logits", action="store_true", help="also bench the logits-input chunked form")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",") if s]
    if args.child:
        vocab, tokens = sizes[0]
        print(
            json.dumps(
                _child(args.child, vocab, tokens, args.hidden, args.chunk_size, args.repeats, args.threads)
            )
        )
        return

    import torch
    from composer_core import __version__

    pairs = [("fused", "naive")] + ([("chunked", "naive_logits")] if args.logits else [])
    rows: list[dict[str, Any]] = []
    print(
        f"generalized JSD (beta=0.5) forward+backward, CPU, {args.threads} threads, H={args.hidden}, "
        f"chunk={args.chunk_size}; peak = ru_maxrss - RSS before the first pass (fresh process each)"
    )
    for vocab, tokens in sizes:
        for ours_name, naive_name in pairs:
            ours = _run(ours_name, vocab, tokens, args)
            naive = _run(naive_name, vocab, tokens, args)
            rel_loss = abs(ours["loss"] - naive["loss"]) / max(abs(naive["loss"]), 1e-30)
            rel_grad = abs(ours["grad_norm"] - naive["grad_norm"]) / max(naive["grad_norm"], 1e-30)
            row = {
                "vocab": vocab,
                "tokens": tokens,
                "ours": ours,
                "naive": naive,
                "peak_ratio": ours["peak_bytes"] / max(naive["peak_bytes"], 1),
                "time_ratio": ours["time_s"] / naive["time_s"],
                "loss_rel_diff": rel_loss,
                "grad_norm_rel_diff": rel_grad,
                "meets_target": ours["peak_bytes"] <= 0.25 * naive["peak_bytes"]
                and ours["time_s"] <= 1.3 * naive["time_s"],
            }
            rows.append(row)
            print(
                f"V={vocab:>6} N={tokens:>5} {ours_name:>7}: {ours['time_s']:7.2f} s {_fmt_bytes(ours['peak_bytes'])} | "
                f"{naive_name:>12}: {naive['time_s']:7.2f} s {_fmt_bytes(naive['peak_bytes'])} | "
                f"peak ratio {row['peak_ratio']:.3f}  time ratio {row['time_ratio']:.3f}  "
                f"(loss rel diff {rel_loss:.1e}) {'OK' if row['meets_target'] else 'MISSES target'}"
            )
    result = {
        "benchmark": "generalized_jsd forward+backward: chunked/fused vs naive",
        "target": "peak <= 0.25x naive at time <= 1.3x naive",
        "machine": {
            "platform": platform.platform(),
            "processor": _cpu_model(),
            "load_average_at_end": os.getloadavg(),
            "cpu_count": os.cpu_count(),
            "threads": args.threads,
            "torch": torch.__version__,
            "composer_core": __version__,
        },
        "method": "fresh subprocess per measurement; peak = ru_maxrss - RSS before first pass; time = median "
        f"of {args.repeats} warm passes",
        "rows": rows,
    }
    out_dir = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_jsd.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out_dir / 'bench_jsd.json'}")


if __name__ == "__main__":
    main()
