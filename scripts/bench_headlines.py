"""The root README's benchmark summary: one headline per committed bench JSON, read from the JSON (never typed).

Each headline is a pure function of one ``packages/<pkg>/bench/results/<name>.json``; it reads the cells of the
JSON's ``readme`` table (by column name and row key) or its raw fields, and raises :class:`LookupError` naming
what it looked for when the JSON no longer has it (``bench_tables.py --check`` then fails lint: a headline never
goes stale silently). ``bench_tables.py`` renders the ``<!-- bench:summary:begin/end -->`` block of the root
README from :data:`HEADLINES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Json = dict[str, Any]


@dataclass(frozen=True)
class Headline:
    package: str  # packages/composer-<package>
    bench: str  # bench/results/<bench>.json
    what: str
    result: Callable[[Json], str]


def cell(data: Json, column: str, **key: object) -> Any:
    """The ``column`` cell of the readme row whose cells match ``key`` (column name → value)."""
    block = data["readme"]
    cols: list[str] = block["columns"]
    missing = [c for c in (column, *key) if c not in cols]
    if missing:
        raise LookupError(f"no column {missing[0]!r} in the readme table (columns: {cols})")
    for row in block["rows"]:
        if all(row[cols.index(c)] == v for c, v in key.items()):
            return row[cols.index(column)]
    raise LookupError(f"no readme row with {key}")


def _num(value: Any) -> float:
    """A table cell as a number (a formatted median such as ``"0.87 [0.85–0.93]"`` gives its median)."""
    return float(str(value).split()[0].replace(",", ""))


def _per_jsd_size(d: Json, part: Callable[[Callable[[str], float]], str]) -> str:
    """``part(col)`` for each fused row of the JSD bench (``col(name)``: that row's cell as a number)."""
    out = []
    for size in ("32,768 × 4,096", "152,064 × 1,024"):

        def col(column: str, size: str = size) -> float:
            return _num(cell(d, column, **{"form": "fused", "V × N": size}))

        out.append(f"V × N = {size}: " + part(col))
    return "; ".join(out)


def _jsd(d: Json) -> str:
    return _per_jsd_size(
        d,
        lambda c: (
            f"time {c('composer / TRL'):.2f}× TRL's, {c('composer / Liger'):.2f}× Liger's, "
            f"{c('composer / floor'):.2f}× the matmul floor, extra memory {c('memory composer / Liger'):.2f}× Liger's"
        ),
    )


def _jsd_cuda(d: Json) -> str:
    return f"{d['machine']['gpu']}: " + _per_jsd_size(
        d,
        lambda c: (
            f"eager {c('composer / floor'):.2f}× the matmul floor, compiled=True {c('compiled / floor'):.2f}× the "
            f"floor and {c('compiled / Liger'):.2f}× Liger's compiled time; extra memory "
            f"{c('memory composer / Liger'):.2f}× Liger's eager, {c('compiled memory / Liger'):.2f}× compiled"
        ),
    )


def _bypass(d: Json) -> str:
    speed = _num(cell(d, "tokens/CPU-s", method="bypass")) / _num(cell(d, "tokens/CPU-s", method="kl"))
    growth = _num(cell(d, "training growth MiB", method="bypass")) / _num(
        cell(d, "training growth MiB", method="kl")
    )
    return f"{speed:.2f}× the tokens per CPU-second; training memory growth {growth:.2f}×"


def _bypass_dist(d: Json) -> str:
    owned = {"mode": "owned", "k": 4}
    return (
        f"k = 4 ranks owning their blocks: {_num(cell(d, 'speedup vs KL', **owned)):.2f}× one-process KL "
        f"tokens/s, {_num(cell(d, 'per-rank parameter MiB (max)', **owned)):.1f} MiB of parameters per rank "
        f"against {_num(cell(d, 'per-rank parameter MiB (max)', mode='full', k=4)):.1f} replicated"
    )


def _trl(d: Json) -> str:
    on = "ComposerGRPOTrainer, 3 channels"
    off = "ComposerGRPOTrainer, channels off"
    return (
        f"3 channels: step time {_num(cell(d, 'vs GRPO', trainer=on)):.2f}× a plain step's, "
        f"{_num(cell(d, 'vs floor', trainer=on)):.2f}× the floor (plain step + the extra forwards alone); "
        f"channels off: {_num(cell(d, 'vs GRPO', trainer=off)):.2f}×"
    )


def _dtype(d: Json) -> str:
    grpo = _num(cell(d, "bf16 / float32", run="grpo"))
    sdpo = _num(cell(d, "bf16 / float32", run="sdpo (success)"))
    support = "with" if d["machine"]["avx512_bf16"] or d["machine"]["amx_tile"] else "without"
    return (
        f"{d['model']}, a CPU {support} AVX512-BF16/AMX: a bf16 step takes {grpo:.2f}× a float32 step's time "
        f"(GRPO), {sdpo:.2f}× (SDPO, EMA teacher)"
    )


def _profile(d: Json) -> str:
    arms = ("grpo", "grpo+sft", "grpo+replay", "sdpo (success)", "sdpo (success + feedback)", "composer")
    if any(r[1] == "trl sdpo" for r in d["readme"]["rows"]):
        arms = (*arms, "trl sdpo")  # TRL's SDPOTrainer: reported, not bound
    parts = []
    for dtype in ("float32", "bf16"):
        if not any(r[0] == dtype for r in d["readme"]["rows"]):
            continue
        ratios = ", ".join(f"{a} {_num(cell(d, 'step/floor', dtype=dtype, arm=a)):.3f}×" for a in arms)
        norms = _num(cell(d, "step/floor", dtype=dtype, arm="composer + log_channel_grad_norms"))
        parts.append(f"{dtype}: {ratios} (composer with the opt-in per-channel grad norms {norms:.3f}×)")
    return (
        "step / floor (the arm replaying its completions beside GRPO on them + the arm's extra work, run at the same "
        "time; grpo: the noise): " + "; ".join(parts)
    )


def _prime_rl(d: Json) -> str:
    row = {"samples × tokens": "32 × 256", "method": "dppo", "layout": "packed"}
    rl = {**row, "layout": "packed_rl_weights"}
    sdpo = {**row, "method": "clipped_surrogate_sdpo"}
    loaded = "ratio vs inline, loaded" in d["readme"]["columns"]
    beside = (
        f" ({_num(cell(d, 'ratio vs inline, loaded', **row)):.2f}× beside a CPU-bound neighbour)"
        if loaded
        else ""
    )
    return (
        f"DPPO, 32 × 256 tokens in PRIME-RL's packed train loop: step time "
        f"{_num(cell(d, 'ratio vs inline', **row)):.2f}×{beside} an inline one-metric formula without validation, "
        f"{_num(cell(d, 'ratio vs prime_rl_default', **row)):.2f}× PRIME-RL's own default_loss_fn (same metrics); "
        f"with an rl weight stream (a fresh mask per sample) {_num(cell(d, 'ratio vs inline', **rl)):.2f}× / "
        f"{_num(cell(d, 'ratio vs prime_rl_default', **rl)):.2f}×; clipped surrogate + SDPO against its own inline "
        f"formula {_num(cell(d, 'ratio vs inline', **sdpo)):.2f}× "
        f"({_num(cell(d, 'ratio vs inline', **{**sdpo, 'layout': 'packed_rl_weights'})):.2f}× with the stream)"
    )


def _object_store(d: Json) -> str:
    ratio = "raw copy (write) time / round (publish) time (median [min–max])"
    measurement = "round vs raw fsspec copy (k=2, full)"
    parts = []
    for mib in (512.0, 64.0, 1.0):
        got = [
            _num(cell(d, ratio, measurement=measurement, store=s, **{"MiB / replica": mib}))
            for s in ("file", "s3")
        ]
        parts.append(f"{mib:g} MiB: {got[0]:.2f} (file) / {got[1]:.2f} (s3)")
    many = f"{measurement[:-1]}, 200 tensors)"  # the 1 MiB round again in a LoRA adapter's layout (since 2026-11-27)
    try:
        got = [_num(cell(d, ratio, measurement=many, store=s)) for s in ("file", "s3")]
    except LookupError:
        return "; ".join(parts)
    return "; ".join([*parts, f"1 MiB in 200 tensors: {got[0]:.2f} (file) / {got[1]:.2f} (s3)"])


def _scaling(d: Json) -> str:
    read = "bytes read / payload per replica-round (median)"
    parts = []
    for mode in ("sharded", "full"):
        got = [
            _num(cell(d, read, measurement=f"replicas as processes, {mode} exchange", k=k)) for k in (2, 4, 8)
        ]
        parts.append(f"{mode} {' / '.join(f'{x:.2f}' for x in got)}")
    return "k = 2 / 4 / 8: " + "; ".join(parts)


def _communication(d: Json) -> str:
    rows = {(r["sync_every"], r["quantized"]): r["ratio_diloco_over_ddp"] for r in d["communication"]}
    try:
        return f"H = 50 fp32: {rows[(50, False)]:.3f}×; H = 50 fp8: {rows[(50, True)]:.3f}×"
    except KeyError as e:
        raise LookupError(f"no communication row for (sync_every, quantized) = {e}") from e


def _monarch_push(d: Json) -> str:
    return (
        f"{_num(cell(d, 'speed-up vs driver-pickle', path='shm')):.1f}× (shared memory), "
        f"{_num(cell(d, 'speed-up vs driver-pickle', path='rdma')):.1f}× (RDMA buffers) the driver-pickled push"
    )


def _monarch_overlap(d: Json) -> str:
    ratio = _num(cell(d, "vs sequential", mode="overlap"))
    return (
        f"{ratio:.2f}× the steps/s of the strictly sequential loop (bound min(ideal, capacity) = "
        f"{float(d['achievable_bound']):.2f}×, parallel capacity {float(d['parallel_capacity_2_procs']):.2f} of 2)"
    )


def _on_gpu(render: Callable[[Json], str]) -> Callable[[Json], str]:
    """A CPU headline's text for the same bench's GPU JSON, prefixed with the card it ran on."""
    return lambda d: f"{d['machine']['gpu']}: {render(d)}"


HEADLINES: tuple[Headline, ...] = (
    Headline("core", "bench_jsd", "generalized JSD fused from hidden states, forward + backward", _jsd),
    Headline("core", "bench_jsd_cuda", "the same on a GPU, eager and with `compiled=True`", _jsd_cuda),
    Headline("core", "bench_bypass", "bypass vs full-model KL distillation, one process", _bypass),
    Headline("core", "bench_bypass_dist", "bypass on gloo processes", _bypass_dist),
    Headline("trl", "bench_trl", "`ComposerGRPOTrainer` step vs plain `GRPOTrainer`", _trl),
    Headline("trl", "bench_trl_cuda", "the same on a GPU", _on_gpu(_trl)),
    Headline("trl", "bench_dtype", "real-model training step, bf16 vs float32 on CPU", _dtype),
    Headline("trl", "bench_profile", "SmolLM2-135M training step per arm vs its floor", _profile),
    Headline("prime-rl", "bench_composer_loss", "`composer_loss` per PRIME-RL step", _prime_rl),
    Headline("prime-rl", "bench_composer_loss_cuda", "the same on a GPU", _on_gpu(_prime_rl)),
    Headline(
        "diloco",
        "diloco",
        "object-store all-reduce, raw copy time / round time (k = 2; 1 = as fast as a copy)",
        _object_store,
    ),
    Headline("diloco", "diloco", "serverless DiLoCo, bytes read per replica-round / payload", _scaling),
    Headline("diloco", "diloco", "DiLoCo bytes per inner step vs DDP", _communication),
    Headline("monarch", "bench_monarch", "Monarch loop, generation/training overlap", _monarch_overlap),
    Headline("monarch", "bench_monarch_push", "Monarch weight push, 127M fp32 parameters", _monarch_push),
)
