"""Benchmark: composer's generalized JSD against TRL's and Liger-Kernel's own functions and the matmul floor.

Forward + backward of the generalized JSD (β = 0.5), float32, on the same inputs, two forms:

- ``fused`` (from hidden states [N, H] and an LM head [V, H]):
  ``composer`` = :func:`composer_core.fused_linear_generalized_jsd` (chunk = ``--chunk-size`` rows, default
  composer's: ``max(FUSED_MIN_ROWS, FUSED_CHUNK_LOGITS // V)`` rows); ``trl`` = logits ``h @ Wᵀ`` materialised for student and teacher, then
  TRL's ``GKDTrainer.generalized_jsd_loss`` with autograd; ``liger`` = Liger-Kernel's
  ``LigerFusedLinearJSDLoss`` (its chunked pure-torch path, ``compiled=False``, its default chunk 1024, hard-loss
  weight 0); ``floor`` = the four matmuls alone (student and teacher logits, both gradients), chunked as composer
  into preallocated buffers: no method can do less arithmetic.
- ``composer_compiled`` (both forms; ``--compiled-kernel``, on by default with ``--device cuda``) = composer with
  ``compiled=True`` (``sdpo_compiled``): the same engine with its chunk kernel under ``torch.compile``
  (:mod:`composer_core.loss.compiled`; inductor fuses the elementwise passes; the cold pass pays the compilation).
- ``logits`` (from [N, V] logits): ``composer`` = :func:`composer_core.generalized_jsd`; ``trl`` = TRL's
  ``generalized_jsd_loss``; ``liger`` = Liger's logits path ``LigerFusedLinearJSDFunction.distillation_loss_fn``
  with autograd.

Every measurement runs in a fresh subprocess (peak = ``ru_maxrss`` − resident set just before the first pass,
the inputs already allocated; tracemalloc cannot see torch's allocations). Methods are interleaved: each round
runs every method once (a cold pass, then ``--inner`` timed warm passes), the order rotating per round; the
reported time is the median over rounds of the warm passes, with min–max as the spread (the machine is shared).
Round 0 also checks that TRL, Liger (and the floor's shapes) agree with composer in value and gradient.
Prints a table and writes ``$COMPOSER_BENCH_OUT/bench_jsd.json`` (with the ``machine`` and ``readme`` blocks of
the project's bench convention; ``scripts/bench_tables.py`` renders the README table from it).

``--device cuda`` runs the same comparison on a GPU: time is wall time between ``torch.cuda.synchronize()``
calls, peak is ``torch.cuda.max_memory_allocated()`` above what was allocated before the first pass, Liger runs
compiled (its default there, ``torch.compile`` of its chunk step; the cold pass pays the compilation, the warm
passes are timed), and the JSON is ``bench_jsd_cuda.json`` (the README's CPU table is not touched).

    python bench/bench_jsd.py [--sizes 32768x4096,152064x1024] [--hidden 896] [--rounds 3] [--small]
                              [--device cuda --inner 5] [--compiled-kernel]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# composer_testkit: composer-core's tests/support, never shipped (CONTRIBUTING.md, Test support)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "composer-core" / "tests" / "support"))

from composer_testkit.machine import cpu_model

DEFAULT_SIZES = [(32_768, 4096), (152_064, 1024)]  # (V, N tokens)
SMALL = {"sizes": [(1024, 32)], "hidden": 32, "rounds": 1, "chunk_size": 16}
"""``--small``: CI's check that the bench works. Both forms and every method (each still in its own process,
with the agreement check), at one tiny size; composer's chunk is below N so its chunk loop runs."""
METHODS = {"fused": ["composer", "trl", "liger", "floor"], "logits": ["composer", "trl", "liger"]}
BETA = 0.5


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---------------------------------------------------------------------------------------------------------
# Child: one method, one size, a fresh process
# ---------------------------------------------------------------------------------------------------------


def _fused_step(method: str, h_s: Any, h_t: Any, w: Any, chunk: int | None) -> Any:
    import torch
    from composer_core import fused_linear_generalized_jsd

    if method == "composer":
        return fused_linear_generalized_jsd(h_s, w, h_t, beta=BETA, chunk_size=chunk)
    if method == "composer_compiled":
        return fused_linear_generalized_jsd(h_s, w, h_t, beta=BETA, chunk_size=chunk, compiled=True)
    if method == "trl":
        from trl.experimental.gkd import GKDTrainer

        logits_s = h_s @ w.T
        with torch.no_grad():
            logits_t = h_t @ w.T
        return GKDTrainer.generalized_jsd_loss(logits_s, logits_t, beta=BETA)
    if method == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        loss_fn = LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA, compiled=h_s.is_cuda
        )
        labels = torch.zeros(h_s.shape[0], dtype=torch.long, device=h_s.device)
        return loss_fn(h_s, w, h_t, w.detach(), labels)
    raise ValueError(method)


def _floor_step(h_s: Any, h_t: Any, w: Any, chunk: int) -> Any:
    """The four matmuls of a fused JSD fwd+bwd (no elementwise work), into preallocated chunk buffers."""
    import torch

    with torch.no_grad():
        n, vocab = h_s.shape[0], w.shape[0]
        zs = torch.empty(min(chunk, n), vocab, device=w.device)
        zt = torch.empty_like(zs)
        gh = torch.empty(min(chunk, n), h_s.shape[1], device=w.device)
        grad_w = torch.zeros_like(w)
        for s in range(0, n, chunk):
            hs, ht = h_s[s : s + chunk], h_t[s : s + chunk]
            c = hs.shape[0]
            torch.matmul(hs, w.T, out=zs[:c])
            torch.matmul(ht, w.T, out=zt[:c])
            torch.matmul(zs[:c], w, out=gh[:c])
            grad_w.addmm_(zs[:c].T, hs)
    return torch.zeros((), device=w.device)


def _logits_step(method: str, z_s: Any, z_t: Any, chunk: int | None) -> Any:
    from composer_core import generalized_jsd

    if method in ("composer", "composer_compiled"):
        return generalized_jsd(z_s, z_t, beta=BETA, chunk_size=chunk, compiled=method == "composer_compiled")
    if method == "trl":
        from trl.experimental.gkd import GKDTrainer

        return GKDTrainer.generalized_jsd_loss(z_s, z_t, beta=BETA)
    if method == "liger":
        from liger_kernel.chunked_loss.jsd_loss import LigerFusedLinearJSDFunction

        return LigerFusedLinearJSDFunction.distillation_loss_fn(z_s, z_t, beta=BETA) / z_s.shape[0]
    raise ValueError(method)


def _make_step(form: str, method: str, args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """(step function returning the loss, leaf tensors with gradients) for one method on seeded inputs."""
    import torch

    vocab, tokens = _parse_sizes(args.sizes)[0]
    g = torch.Generator().manual_seed(0)
    dev = args.device
    if form == "fused":
        h_s = (torch.randn(tokens, args.hidden, generator=g) * 0.5).to(dev).requires_grad_(True)
        h_t = (torch.randn(tokens, args.hidden, generator=g) * 0.5).to(dev)
        w = (torch.randn(vocab, args.hidden, generator=g) * 2 / args.hidden**0.5).to(dev).requires_grad_(True)
        if method == "floor":
            from composer_core.loss.distill import chunk_rows

            chunk = chunk_rows(args.chunk_size, vocab, fused=True)
            return (lambda: _floor_step(h_s, h_t, w.detach(), chunk)), [h_s, w]
        return (lambda: _fused_step(method, h_s, h_t, w, args.chunk_size)), [h_s, w]
    z_s = (torch.randn(tokens, vocab, generator=g) * 2).to(dev).requires_grad_(True)
    z_t = (torch.randn(tokens, vocab, generator=g) * 2).to(dev)
    return (lambda: _logits_step(method, z_s, z_t, args.chunk_size)), [z_s]


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    form, method = args.child.split(":")
    step, params = _make_step(form, method, args)
    cuda = args.device == "cuda"

    def run() -> float:
        for p in params:
            p.grad = None
        loss = step()
        if loss.requires_grad:
            loss.backward()
        return float(loss.detach())  # a host read: on CUDA the pass is complete when it returns

    if method == "trl":  # imports are not part of the measured peak
        import trl.experimental.gkd  # noqa: F401
    elif method == "liger":
        import liger_kernel.chunked_loss  # noqa: F401
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else _rss_bytes()
    t0 = time.perf_counter()
    value = run()
    cold = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if cuda else _maxrss_bytes()) - base
    if args.save:  # round 0: loss and (row-subsampled) gradients for the agreement check
        grads = [p.grad[:: max(1, p.shape[0] // 256)].cpu() for p in params if p.grad is not None]
        torch.save({"loss": value, "grads": grads}, args.save)
    times = []
    for _ in range(args.inner):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {"loss": value, "peak_bytes": peak, "cold_s": cold, "times_s": times}


# ---------------------------------------------------------------------------------------------------------
# Parent: interleaved rounds, agreement, ratios, JSON
# ---------------------------------------------------------------------------------------------------------


def _chunk_text(chunk_size: int | None) -> str:
    """composer's chunk as the title states it: its default sizes the rows by V."""
    if chunk_size is not None:
        return f"{chunk_size} rows"
    from composer_core.loss.distill import CHUNK_LOGITS, FUSED_CHUNK_LOGITS, FUSED_MIN_ROWS

    return (
        f"its default, max({FUSED_MIN_ROWS}, {FUSED_CHUNK_LOGITS:,} // V) rows fused and {CHUNK_LOGITS:,} // V "
        "on logits"
    )


def _parse_sizes(text: str) -> list[tuple[int, int]]:
    return [(int(v), int(n)) for v, n in (s.split("x") for s in text.split(",") if s)]


def _spawn(
    form: str, method: str, vocab: int, tokens: int, args: argparse.Namespace, save: str
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", f"{form}:{method}", "--sizes", f"{vocab}x{tokens}"]
    cmd += ["--hidden", str(args.hidden), "--inner", str(args.inner)]
    cmd += [] if args.chunk_size is None else ["--chunk-size", str(args.chunk_size)]
    cmd += ["--threads", str(args.threads), "--save", save, "--device", args.device]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _agreement(files: dict[str, str]) -> dict[str, dict[str, float]]:
    """Relative difference of loss and of each (subsampled) gradient against composer's."""
    import torch

    ref = torch.load(files["composer"], weights_only=True)
    out: dict[str, dict[str, float]] = {}
    for method, path in files.items():
        if method in ("composer", "floor"):
            continue
        other = torch.load(path, weights_only=True)
        grad_diff = max(
            float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
            for a, b in zip(other["grads"], ref["grads"], strict=True)
        )
        out[method] = {
            "loss_rel": abs(other["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30),
            "grad_rel": grad_diff,
        }
    return out


def _measure(form: str, vocab: int, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    methods = METHODS[form] + (["composer_compiled"] if args.compiled_kernel else [])
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        files = {m: str(Path(tmp) / f"{m}.pt") for m in methods}
        for r in range(args.rounds):
            order = methods[r % len(methods) :] + methods[: r % len(methods)]
            for m in order:
                runs[m].append(_spawn(form, m, vocab, tokens, args, files[m] if r == 0 else ""))
                done = runs[m][-1]
                warm = statistics.median(done["times_s"]) if done["times_s"] else done["cold_s"]
                print(  # progress: one line per measured process (a full run takes tens of minutes)
                    f"  {form} V={vocab} N={tokens} round {r + 1}/{args.rounds} {m}: {warm:.2f} s, "
                    f"{done['peak_bytes'] / 2**20:,.0f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
        agree = _agreement(files)
    stats: dict[str, dict[str, float]] = {}
    for m, rs in runs.items():
        warm = [statistics.median(x["times_s"]) if x["times_s"] else x["cold_s"] for x in rs]
        stats[m] = {
            "time_s": statistics.median(warm),
            "time_min_s": min(warm),
            "time_max_s": max(warm),
            "peak_bytes": statistics.median(x["peak_bytes"] for x in rs),
            "loss": rs[0]["loss"],
        }
    ours = stats["composer"]
    ratios = {f"time_vs_{m}": ours["time_s"] / stats[m]["time_s"] for m in methods if m != "composer"}
    ratios |= {f"peak_vs_{m}": ours["peak_bytes"] / max(stats[m]["peak_bytes"], 1) for m in ("trl", "liger")}
    if "composer_compiled" in stats:
        compiled = stats["composer_compiled"]
        ratios |= {
            f"compiled_time_vs_{m}": compiled["time_s"] / stats[m]["time_s"] for m in METHODS[form][1:]
        }
        ratios["compiled_peak_vs_liger"] = compiled["peak_bytes"] / max(stats["liger"]["peak_bytes"], 1)
    return {
        "form": form,
        "vocab": vocab,
        "tokens": tokens,
        "methods": stats,
        "ratios": ratios,
        "agreement": agree,
    }


def _fmt_time(s: dict[str, float]) -> str:
    if s["time_max_s"] < 1.0:  # sub-second runs (a GPU, --small): milliseconds
        return f"{s['time_s'] * 1e3:.1f} ms [{s['time_min_s'] * 1e3:.1f}–{s['time_max_s'] * 1e3:.1f}]"
    return f"{s['time_s']:.2f} s [{s['time_min_s']:.2f}–{s['time_max_s']:.2f}]"


def _readme(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    table = []
    compiled = any("composer_compiled" in row["methods"] for row in rows)
    for row in rows:
        ms, r = row["methods"], row["ratios"]
        mib = {m: f"{ms[m]['peak_bytes'] / 2**20:,.0f}" for m in ("composer", "trl", "liger")}
        extra = [
            _fmt_time(ms["composer_compiled"]) if "composer_compiled" in ms else "–",
            *(
                round(r[k], 2) if k in r else "–"
                for k in ("compiled_time_vs_floor", "compiled_time_vs_liger", "compiled_peak_vs_liger")
            ),
        ]
        table.append(
            [
                row["form"],
                f"{row['vocab']:,} × {row['tokens']:,}",
                _fmt_time(ms["composer"]),
                _fmt_time(ms["trl"]),
                _fmt_time(ms["liger"]),
                _fmt_time(ms["floor"]) if "floor" in ms else "–",
                round(r["time_vs_floor"], 2) if "time_vs_floor" in r else "–",
                round(r["time_vs_trl"], 2),
                round(r["time_vs_liger"], 2),
                f"{mib['composer']} / {mib['trl']} / {mib['liger']}",
                round(r["peak_vs_liger"], 2),
                *(extra if compiled else []),
            ]
        )
    cuda = args.device == "cuda"
    return {
        "title": f"Generalized JSD (β = 0.5) forward + backward, float32, H = {args.hidden}, composer chunk = "
        f"{_chunk_text(args.chunk_size)}{', CUDA' if cuda else ''}: median of {args.rounds} interleaved rounds "
        "[min–max]" + (f" of the median of {args.inner} warm passes" if args.inner > 1 else ""),
        "columns": [
            "form",
            "V × N",
            "composer",
            "TRL",
            "Liger",
            "matmul floor",
            "composer / floor",
            "composer / TRL",
            "composer / Liger",
            "extra memory MiB (composer / TRL / Liger)",
            "memory composer / Liger",
            *(
                ["composer compiled=True", "compiled / floor", "compiled / Liger", "compiled memory / Liger"]
                if compiled
                else []
            ),
        ],
        "rows": table,
        "note": "TRL: `GKDTrainer.generalized_jsd_loss` on materialised logits; Liger: `LigerFusedLinearJSDLoss` "
        f"(compiled={cuda}) / `distillation_loss_fn` for logits; floor: the 4 matmuls alone. Values and gradients "
        "agree (see `agreement` in the JSON)."
        + (" Memory: `torch.cuda.max_memory_allocated` above the inputs." if cuda else ""),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sizes", default=",".join(f"{v}x{n}" for v, n in DEFAULT_SIZES), help="VxN,VxN,...")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="composer's rows per chunk (default: distill.chunk_rows, by form and V)",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (fresh process per method each)")
    p.add_argument("--inner", type=int, default=1, help="warm passes timed per process")
    p.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("COMPOSER_BENCH_THREADS", min(2, os.cpu_count() or 1))),
    )
    p.add_argument("--forms", default="fused,logits")
    p.add_argument(
        "--small", action="store_true", help="tiny sizes, one round: CI's check that the bench works"
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--compiled-kernel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time composer with compiled=True (its chunk kernel under torch.compile; default: on with CUDA)",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--save", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compiled_kernel is None:
        args.compiled_kernel = args.device == "cuda"
    if args.child:
        print(json.dumps(_child(args)))
        return
    if args.small:
        args.sizes = ",".join(f"{v}x{n}" for v, n in SMALL["sizes"])
        args.hidden, args.rounds, args.chunk_size = SMALL["hidden"], SMALL["rounds"], SMALL["chunk_size"]

    import torch

    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} threads"
    print(
        f"generalized JSD (beta={BETA}) forward+backward, {where}, H={args.hidden}, "
        f"composer chunk={_chunk_text(args.chunk_size)}, {args.rounds} interleaved rounds (fresh process per run)"
    )
    rows: list[dict[str, Any]] = []
    out_dir = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / ("bench_jsd.json" if args.device == "cpu" else f"bench_jsd_{args.device}.json")
    for form in args.forms.split(","):
        for vocab, tokens in _parse_sizes(args.sizes):
            row = _measure(form, vocab, tokens, args)
            rows.append(row)
            ms, r = row["methods"], row["ratios"]
            print(
                f"{form:>6} V={vocab:>6} N={tokens:>5}  "
                + "  ".join(f"{m} {_fmt_time(s)} {s['peak_bytes'] / 2**20:,.0f} MiB" for m, s in ms.items())
            )
            print("        ratios " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()))
            print(
                "        agreement "
                + "  ".join(
                    f"{m}: loss {a['loss_rel']:.1e} grad {a['grad_rel']:.1e}"
                    for m, a in row["agreement"].items()
                )
            )
            for m, a in row["agreement"].items():
                if a["loss_rel"] > 1e-4 or a["grad_rel"] > 1e-3:
                    raise SystemExit(f"bench_jsd: {m} disagrees with composer ({a}); the comparison is void.")
            _write(out, rows, args, complete=False)  # a run stopped midway keeps its finished rows
    _write(out, rows, args, complete=True)
    print(f"wrote {out}")


def _write(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace, *, complete: bool) -> None:
    """The bench JSON of ``rows``; ``complete`` is False while rows are still to come."""
    import torch
    from composer_core import __version__

    result = {
        "benchmark": "generalized JSD forward+backward: composer vs TRL vs Liger vs matmul floor",
        "targets": {"fused time / floor": 1.5, "fused memory / Liger": 0.35, "logits memory / Liger": 0.35},
        "machine": {
            "processor": cpu_model(),
            **({"gpu": torch.cuda.get_device_name()} if args.device == "cuda" else {}),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "threads": args.threads,
            "load_average": os.getloadavg(),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__,
            "composer_core": __version__,
        },
        "config": {
            "hidden": args.hidden,
            "chunk_size": args.chunk_size,
            "rounds": args.rounds,
            "inner": args.inner,
            "small": args.small,
            "compiled_kernel": args.compiled_kernel,
        },
        "complete": complete,
        "rows": rows,
        "readme": _readme(rows, args),
    }
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
