"""Per-step cost of ``composer_loss`` in PRIME-RL's per-sample loop, side by side with the inline
plain-torch formula of the same loss (DPPO + KL, PRIME-RL's default; or the clipped surrogate + SDPO; no
validation, one metric; :data:`MATCHED`) and, when a PRIME-RL checkout is given (``--prime-rl-src`` /
``$PRIME_RL_SRC``) or ``prime_rl`` is importable, PRIME-RL's own ``default_loss_fn`` (the DPPO formula with its
seven metrics: the information-matched anchor of DPPO, since composer_loss returns the same seven).

One "step" = PRIME-RL's ``compute_loss`` pattern: call the loss once per packed sample, sum,
divide by the token count, backward. Three layouts: ``packed`` is PRIME-RL's train loop (one ``[1, N]`` tensor
per field for the micro-batch, each call getting ``packed.squeeze().split(sequence_lengths)`` views);
``packed_rl_weights`` is the same loop when the micro-batch carries an rl weight stream (PRIME-RL's orchestrator
prunes zero-advantage tokens or routes a sample to the ce / ref_kl component, and the packer fills 1.0 for the
other samples): ``compute_loss`` then reads ``bool(rl_mask.any())`` and passes ``loss_mask = mask & (rl_weights !=
0)``, a fresh tensor, with ``loss_weights`` = the stream's view, for every method alike; ``separate`` gives each
sample its own tensors (a caller that builds them one by one). Before a layout is timed, each composer
configuration is checked to give the same loss and gradient as its anchors (:func:`check_agreement`).
composer_loss validates every value (NaN/inf, 0/1 mask, overflow) with one host read on CPU per micro-batch when
packed (per sample when separate) plus the structural checks in Python on every call; this measures what that
costs. Every layout is timed twice: as the machine is, and beside a CPU-bound neighbour process the bench starts
and stops itself (bounded by ``--neighbour-s``), so both ratios are printed side by side. It also times reading
the typed options (``parse_options``) per call beside the call's own cost. Prints the ratios and writes JSON to
$COMPOSER_BENCH_OUT (default ./bench-results).

    python bench/bench_composer_loss.py [--samples 32] [--lengths 256,4096] [--repeats 15] [--threads 1]
                                        [--prime-rl-src PATH] [--device cuda]

Besides wall time (noisy on a shared machine) it counts the aten operators one sample's forward + backward
dispatches per method: a load-independent measure of the per-call overhead that dominates small samples.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# composer_testkit: composer-core's tests/support, never shipped (CONTRIBUTING.md, Test support)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "composer-core" / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # prime_rl_upstream: test support too

import torch
from composer_prime_rl import LossInputs, LossOutputs, composer_loss
from composer_prime_rl.options import parse_options
from composer_testkit.host_reads import RecordOps
from composer_testkit.machine import cpu_model
from prime_rl_upstream import UpstreamUnavailable, load_upstream


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
    if inputs.loss_weights is not None:  # as PRIME-RL's default_loss_fn
        per_token = per_token * inputs.loss_weights
    return LossOutputs(loss=per_token.sum(), metrics={"is_masked": masked.float().mean()})


def inline_clipped_sdpo(
    inputs: Any, epsilon: float = 0.2, alpha_sdpo: float = 1.0, token_clip: float = 2.0
) -> LossOutputs:
    """The clipped surrogate + α · sampled-token SDPO written directly (composer's ``policy_loss =
    "clipped_surrogate", alpha_sdpo = 1`` at its defaults; no validation, one metric): the information-matched
    inline anchor of that configuration."""
    lp, inf = inputs.trainer_logprobs, inputs.inference_logprobs
    ratio = torch.exp(lp - inf)
    adv = inputs.advantages
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    policy = -torch.min(ratio * adv, clipped * adv)
    d = (lp - inputs.ref_logprobs).detach()
    with torch.no_grad():
        weight = torch.exp(torch.clamp(lp - inf, -20.0, 20.0)).clamp(max=token_clip)
    sdpo = (d + d * (lp - lp.detach())) * weight  # value d·w, gradient d·w·∇ℓ (the k1 surrogate)
    per_token = inputs.loss_mask * (policy + alpha_sdpo * sdpo)
    if inputs.loss_weights is not None:
        per_token = per_token * inputs.loss_weights
    return LossOutputs(loss=per_token.sum(), metrics={"clip_ratio": (ratio != clipped).float().mean()})


#: each composer configuration -> the inline formula of the same loss (its information-matched inline anchor)
MATCHED = {"composer_dppo": "inline_dppo_kl", "composer_clipped_surrogate_sdpo": "inline_clipped_sdpo"}

#: layout -> (views of packed micro-batch tensors, an rl weight stream)
LAYOUTS = {"packed": (True, False), "packed_rl_weights": (True, True), "separate": (False, False)}


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
                # an rl weight stream: zero-advantage tokens pruned (0) on the first tenth, PRIME-RL's fill 1.0
                "w": (torch.arange(length) >= length // 10).to(torch.float32).to(device),
            }
        )
    return samples


def pack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """PRIME-RL's micro-batch: each field's samples concatenated into one ``[1, N]`` tensor."""
    return {key: torch.cat([s[key] for s in samples])[None] for key in samples[0]}


def step(
    fn: Callable[..., LossOutputs],
    samples: list[dict[str, torch.Tensor]],
    kwargs: dict[str, Any],
    packed: dict[str, torch.Tensor] | None = None,
    rl_weights: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One step: with ``packed``, PRIME-RL's train loop (the forward's ``[1, N]`` log-probs and the micro-batch
    tensors, each split by sequence length); else every sample's own tensors. ``rl_weights``: ``compute_loss``'s
    path for a micro-batch with an rl weight stream (a fresh mask per sample, its host read included). Returns
    the step's loss and the log-prob leaves (their ``.grad`` filled; read by :func:`check_agreement` only)."""
    lengths = [s["lp"].shape[0] for s in samples]
    if packed is not None:
        leaf = packed["lp"].clone().requires_grad_(True)
        split = {key: t.squeeze(0).split(lengths) for key, t in {**packed, "lp": leaf}.items()}
        fields = [{key: split[key][i] for key in split} for i in range(len(samples))]
    else:
        fields = [{**s, "lp": s["lp"].clone().requires_grad_(True)} for s in samples]
    total = fields[0]["lp"].sum() * 0.0
    for f in fields:
        mask, weights = f["mask"], None
        if rl_weights:  # PRIME-RL's compute_loss: a fresh mask, and a sample without rl tokens is not called
            mask, weights = mask & (f["w"] != 0), f["w"]
            if not bool(mask.any()):
                continue
        total = total + fn(LossInputs(f["lp"], f["inf"], f["ref"], f["adv"], mask, weights), **kwargs).loss
    loss = total / sum(lengths)
    loss.backward()
    return loss, [leaf] if packed is not None else [f["lp"] for f in fields]


def _loss_and_grad(
    method: tuple[Callable[..., LossOutputs], dict[str, Any]],
    samples: list[dict[str, torch.Tensor]],
    packed: dict[str, torch.Tensor] | None,
    rl_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's loss and the gradient of every log-prob (flat)."""
    loss, leaves = step(method[0], samples, method[1], packed, rl_weights)
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]
    return loss.detach(), torch.cat([g.view(-1) for g in grads])


def check_agreement(
    methods: dict[str, tuple[Callable[..., LossOutputs], dict[str, Any]]],
    samples: list[dict[str, torch.Tensor]],
    packed: dict[str, torch.Tensor] | None,
    rl_weights: bool,
) -> None:
    """Each composer configuration and its inline formula (and PRIME-RL's default_loss_fn, DPPO's) give the same
    step loss and gradient, so the ratios compare the same computation; raises otherwise."""
    pairs = [*MATCHED.items(), ("composer_dppo", "prime_rl_default_loss_fn")]
    for ours, anchor in (p for p in pairs if p[1] in methods):
        (a_loss, a_grad), (b_loss, b_grad) = (
            _loss_and_grad(methods[n], samples, packed, rl_weights) for n in (ours, anchor)
        )
        if not (torch.allclose(a_loss, b_loss, rtol=1e-5, atol=1e-7)
                and torch.allclose(a_grad, b_grad, rtol=1e-4, atol=1e-9)):  # fmt: skip
            raise SystemExit(
                f"{ours} and {anchor} disagree (loss {a_loss.item()} vs {b_loss.item()}, largest gradient "
                f"difference {(a_grad - b_grad).abs().max().item():.3g}): the bench would compare different work."
            )


def op_count(
    fn: Callable[..., LossOutputs],
    samples: list[dict[str, torch.Tensor]],
    kwargs: dict[str, Any],
    packed: dict[str, torch.Tensor] | None,
    rl_weights: bool,
) -> float:
    """aten operators one sample's loss forward + backward dispatches (metrics included): a whole step's count
    less the same step's with a loss that does nothing, over the samples (the micro-batch's shared work is
    spread over its samples when packed)."""
    with RecordOps() as counter:
        step(fn, samples, kwargs, packed, rl_weights)
    with RecordOps() as bare:
        step(_nothing, samples, {}, packed, rl_weights)
    return (len(counter.ops) - len(bare.ops)) / len(samples)


_NOTHING = torch.zeros(())


def _nothing(inputs: Any) -> LossOutputs:
    """The step's frame alone (what op_count subtracts): a constant loss, no operator."""
    return LossOutputs(loss=_NOTHING, metrics={})


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
    packed: dict[str, torch.Tensor] | None,
    rl_weights: bool,
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
        step(fn, samples, kwargs, packed, rl_weights)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, kwargs = methods[name]
            sync()
            t0 = clock()
            step(fn, samples, kwargs, packed, rl_weights)
            sync()
            times[name].append((clock() - t0) * 1e3)
    return times


#: the neighbour: CPU-bound pure Python over an 8 MiB list (a busy process beside the trainer), ending by itself
NEIGHBOUR = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nx = list(range(1 << 20))\n" \
    "while time.monotonic() < end:\n    sum(x)\n"  # fmt: skip


@contextlib.contextmanager
def neighbour(limit_s: float) -> Iterator[dict[str, Any]]:
    """A CPU-bound neighbour process for the block (it stops by itself after ``limit_s``, and is stopped at the
    block's end); yields what the JSON records of it."""
    proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(limit_s)])
    info: dict[str, Any] = {"started": True, "limit_s": limit_s, "stopped": False}
    try:
        time.sleep(0.2)  # it is running before the first step is timed
        info["running_when_timed"] = proc.poll() is None
        yield info
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        info["stopped"] = True


def options_us(kwargs: dict[str, Any], number: int = 20000) -> float:
    """Microseconds composer_loss spends per call reading its typed options (``parse_options`` of the kwargs
    PRIME-RL passes on every call; the best of 5)."""
    return min(timeit.repeat(lambda: parse_options(dict(kwargs)), number=number, repeat=5)) / number * 1e6


def ratios(methods: dict[str, Any], times: dict[str, list[float]]) -> dict[str, Any]:
    """Each method's ratio per interleaved repeat against each of its anchors: median and range."""
    out: dict[str, Any] = {}
    for name in methods:
        for anchor in anchors_of(name, methods).values():
            per = [a / b for a, b in zip(times[name], times[anchor], strict=True)]
            out[f"{name}_ratio_vs_{anchor}"] = statistics.median(per)
            out[f"{name}_ratio_vs_{anchor}_spread"] = [min(per), max(per)]
    return out


#: the README's ratio columns: (column, the anchor's JSON name, or None for each composer configuration's MATCHED)
COLUMNS = (("ratio vs inline", None), ("ratio vs prime_rl_default", "prime_rl_default_loss_fn"))


def anchors_of(name: str, methods: dict[str, Any]) -> dict[str, str]:
    """column -> the anchor ``name`` is compared with there: a composer configuration with its own inline formula
    and with PRIME-RL's default_loss_fn (when measured), PRIME-RL's with the inline DPPO + KL, an inline formula
    with none."""
    if name == "prime_rl_default_loss_fn":
        return {COLUMNS[0][0]: "inline_dppo_kl"}
    if name not in MATCHED:
        return {}
    return {col: anchor or MATCHED[name] for col, anchor in COLUMNS if (anchor or MATCHED[name]) in methods}


def measure(
    methods: dict[str, tuple[Callable[..., LossOutputs], dict[str, Any]]],
    samples: list[dict[str, torch.Tensor]],
    packed: dict[str, torch.Tensor] | None,
    rl_weights: bool,
    repeats: int,
    neighbour_s: float,
) -> dict[str, Any]:
    """One size and layout: times, operator counts, the options' cost per call, and each method's ratio per
    interleaved repeat against each of its anchors (side by side), with its median and range; ``loaded``: the
    same timing beside a CPU-bound neighbour (:func:`neighbour`)."""
    check_agreement(methods, samples, packed, rl_weights)
    times = interleaved(methods, samples, repeats, packed, rl_weights)
    with neighbour(neighbour_s) as busy:
        loaded = interleaved(methods, samples, repeats, packed, rl_weights)
    ops = {name: op_count(fn, samples, kw, packed, rl_weights) for name, (fn, kw) in methods.items()}
    row: dict[str, Any] = {"times_ms": times, "ops_per_sample": ops}
    row["options_us_per_call"] = {
        name: options_us(kw) for name, (fn, kw) in methods.items() if fn is composer_loss
    }
    for name in methods:
        row[f"{name}_ms"] = statistics.median(times[name])
        row[f"{name}_spread_ms"] = [min(times[name]), max(times[name])]
    row |= ratios(methods, times)
    row["loaded"] = {"neighbour": busy, "times_ms": loaded, **ratios(methods, loaded)}
    return row


def readme_rows(row: dict[str, Any], methods: dict[str, Any], columns: list[str]) -> list[list[str | float]]:
    """The README table's rows of one measurement (and the same figures printed)."""
    where = f"[{row['device']}, {row['layout']}, {row['samples']} x {row['length']} tokens]"
    out: list[list[str | float]] = []
    for name in methods:
        cells = []
        anchors = anchors_of(name, methods)
        for column in columns:
            loaded = column.endswith(", loaded")
            anchor = anchors.get(column.removesuffix(", loaded"))
            if anchor is None:
                cells.append("—")
                continue
            src = row["loaded"] if loaded else row
            ratio = src[f"{name}_ratio_vs_{anchor}"]
            lo, hi = src[f"{name}_ratio_vs_{anchor}_spread"]
            cells.append(f"{ratio:.2f} [{lo:.2f}–{hi:.2f}]")
            if loaded:
                print(
                    f"{where} {name} vs {anchor} beside a CPU-bound neighbour -> {ratio:.2f}x [{lo:.2f}-{hi:.2f}]"
                )
                continue
            print(
                f"{where} {name}: {row[f'{name}_ms']:.2f} ms/step, {row['ops_per_sample'][name]:.1f} ops/sample vs "
                f"{anchor} {row[f'{anchor}_ms']:.2f} ms/step -> {ratio:.2f}x [{lo:.2f}-{hi:.2f}]"
            )
        options = row["options_us_per_call"].get(name)
        if options is not None:
            per_call = row[f"{name}_ms"] * 1e3 / row["samples"]
            print(f"{where} {name}: reading the typed options {options:.2f} us of {per_call:.0f} us per call")
        out.append(
            [row["device"], row["layout"], f"{row['samples']} × {row['length']}", name.removeprefix("composer_"),
             f"{row[f'{name}_ms']:.1f}", f"{row['ops_per_sample'][name]:.1f}",
             "—" if options is None else f"{options:.1f} of {per_call:.0f}", *cells]
        )  # fmt: skip
    return out


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
    parser.add_argument(
        "--neighbour-s",
        type=float,
        default=600.0,
        help="the loaded runs' neighbour stops by itself after this",
    )
    parser.add_argument("--prime-rl-src", default=None, help="a prime-rl checkout (default: $PRIME_RL_SRC)")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: time on the GPU (wall clock around synchronized steps), JSON bench_composer_loss_cuda.json",
    )
    args = parser.parse_args()
    if args.small:
        args.samples, args.lengths, args.repeats = 4, "64", 3
    if args.threads != 1:
        parser.error("--threads: the CPU clock is process time, which sums threads; keep --threads 1")
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    devices = [torch.device(args.device)]
    upstream = prime_rl_default(args.prime_rl_src)
    methods: dict[str, tuple[Callable[..., LossOutputs], dict[str, Any]]] = {
        "inline_dppo_kl": (inline_dppo_kl, {}),
        "inline_clipped_sdpo": (inline_clipped_sdpo, {}),
        **({"prime_rl_default_loss_fn": (upstream, {})} if upstream else {}),
        "composer_dppo": (composer_loss, {}),
        "composer_clipped_surrogate_sdpo": (
            composer_loss,
            {"policy_loss": "clipped_surrogate", "alpha_sdpo": 1.0},
        ),
    }
    columns = [col for col, anchor in COLUMNS if anchor is None or anchor in methods]
    columns.insert(1, f"{columns[0]}, loaded")
    results, table = [], []
    for device in devices:
        for length in (int(x) for x in args.lengths.split(",")):
            samples = make_samples(args.samples, length, device)
            for layout, (views, rl_weights) in LAYOUTS.items():
                packed = pack(samples) if views else None
                row = measure(methods, samples, packed, rl_weights, args.repeats, args.neighbour_s)
                row |= {"device": device.type, "layout": layout, "samples": args.samples, "length": length,
                        "repeats": args.repeats, "cpu_threads": args.threads}  # fmt: skip
                table += readme_rows(row, methods, columns)
                results.append(row)
    out = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / (
        "bench_composer_loss.json" if args.device == "cpu" else f"bench_composer_loss_{args.device}.json"
    )
    clock = "the wall clock around synchronized steps" if args.device == "cuda" else "CPU time of the process"
    doc = {
        "benchmark": "composer_prime_rl.composer_loss per PRIME-RL step vs the inline formula of the same loss and "
        "PRIME-RL's default_loss_fn",
        "target": "ratio vs inline <= 1.2 on the packed layout, quiet and beside a CPU-bound neighbour",
        "machine": {
            "processor": cpu_model(),
            "cpu_count": os.cpu_count(),
            "threads": args.threads,
            "load_average": os.getloadavg(),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__,
            **({"gpu": torch.cuda.get_device_name()} if args.device == "cuda" else {}),
        },
        "rows": results,
        "readme": {
            "title": f"composer_loss per step (PRIME-RL's per-sample loop, forward + backward) vs the inline "
            f"formula of the same loss (DPPO+KL, or clipped surrogate + SDPO; one metric, no validation) and "
            f"PRIME-RL's own default_loss_fn (DPPO+KL with its seven metrics, as composer's): "
            f"median of {args.repeats} interleaved repeats [ratio range], {clock}; loaded = the same beside a "
            f"CPU-bound neighbour process the bench starts and stops; layout "
            f"packed = PRIME-RL's train loop (views of [1, N] micro-batch tensors), packed_rl_weights = the same loop "
            f"with an rl weight stream (a fresh mask per sample), separate = each sample's own tensors; ops = aten "
            f"operators per sample (forward + backward); options = µs a call spends reading its typed options, of its "
            f"µs per call",
            "columns": [
                "device",
                "layout",
                "samples × tokens",
                "method",
                "ms / step",
                "ops / sample",
                "options µs / call",
                *columns,
            ],
            "rows": table,
        },
    }
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
