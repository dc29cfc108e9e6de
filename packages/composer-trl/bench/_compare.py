"""Shared code of the comparison benchmarks (``compare_tiny.py``, ``compare_smollm2.py``): greedy held-out scoring,
the information-matched ``grpo+sft`` trainer, cells written atomically, the README block filler and the plot.

Not part of the installed package: the comparisons are benchmarks, run as scripts from a checkout.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trl import GRPOTrainer

SFT_WEIGHT = 1.0
"""Weight of the SFT term of ``grpo+sft`` (the weight of composer's channel-3 term, ``beta_replay``)."""


class GRPOPlusSFTTrainer(GRPOTrainer):
    """Plain GRPO plus ``SFT_WEIGHT`` x mean token NLL of the row's ``chosen`` answer given its prompt."""

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        out = super()._generate_and_score_completions(inputs)
        tok: Any = self.processing_class
        device = out["prompt_ids"].device
        seqs, targets = [], []
        for row in inputs:
            prompt = row["prompt"]
            if not isinstance(prompt, str):  # a chat prompt: the text the policy was prompted with
                prompt = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            p = tok(prompt, add_special_tokens=False)["input_ids"]
            c = [*tok(row["chosen"], add_special_tokens=False)["input_ids"], tok.eos_token_id]
            seqs.append(p + c)
            targets.append([0] * len(p) + [1] * len(c))
        n = max(len(s) for s in seqs)
        pad = tok.pad_token_id
        out["sft_ids"] = torch.tensor([s + [pad] * (n - len(s)) for s in seqs], device=device)
        out["sft_attn"] = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs], device=device)
        out["sft_target"] = torch.tensor([t + [0] * (n - len(t)) for t in targets], device=device)
        return out

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        import torch.nn.functional as F

        loss = super().compute_loss(model, inputs, *args, **kwargs)
        ids, attn, target = inputs["sft_ids"], inputs["sft_attn"], inputs["sft_target"]
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        mask = target[:, 1:].to(nll.dtype)
        sft = (nll * mask).sum() / mask.sum().clamp_min(1.0)
        self._metrics["train"]["sft/nll"].append(float(sft.detach()))
        return loss + SFT_WEIGHT * sft


def greedy_scores(
    model: Any,
    tok: Any,
    prompts: Sequence[Any],
    max_new_tokens: int,
    verify: Callable[..., float],
    *,
    batch: int = 64,
    autocast: Any = None,
) -> dict[str, Any]:
    """Greedy completions of ``prompts`` (chat prompts through the chat template), scored by ``verify``: per-prompt
    scores, exact-match rate, mean partial credit, the fraction cut off at ``max_new_tokens`` and the seconds."""
    import contextlib

    import torch

    start = time.perf_counter()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    scores: list[float] = []
    cut = 0
    eos = model.generation_config.eos_token_id  # a reply is cut off when none of these ends it in the budget
    ends = set(eos if isinstance(eos, list) else [eos if eos is not None else tok.eos_token_id])
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        texts = [
            p
            if isinstance(p, str)
            else tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
            for p in chunk
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad(), autocast if autocast is not None else contextlib.nullcontext():
            gen = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
            )
        new = gen[:, enc["input_ids"].shape[1] :]
        cut += sum(not ends & set(row) for row in new.tolist())
        answers = tok.batch_decode(new, skip_special_tokens=True)
        scores += [float(verify(p, t)) for p, t in zip(chunk, answers, strict=True)]
    if was_training:
        model.train()
    return {
        "exact_match": sum(s == 1.0 for s in scores) / len(scores),
        "partial_credit": sum(scores) / len(scores),
        "truncated": cut / len(scores),
        "per_prompt": scores,
        "seconds": time.perf_counter() - start,
    }


def stats(values: Sequence[float | None]) -> dict[str, float]:
    """Mean, sample standard deviation and count of the finite values."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    return {
        "mean": statistics.fmean(vals),
        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "n": len(vals),
    }


def mean_std(run: Mapping[str, Any], keys: tuple[str, ...]) -> list[str]:
    """``mean ± std`` table cells of a run's :func:`stats` entries ``keys``."""
    return [f"{run[k]['mean']:.3f} ± {run[k]['std']:.3f}" for k in keys]


def machine(threads: int) -> dict[str, Any]:
    """The machine block of a result (the convention of ``scripts/bench_tables.py``), load average included."""
    import torch

    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").is_file():
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "avx512_bf16": cpu_has_bf16(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "load_average": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def cpu_has_bf16() -> bool:
    """Whether /proc/cpuinfo lists avx512_bf16 (bf16 autocast is then native, 0.68x the float32 step here)."""
    info = Path("/proc/cpuinfo")
    return info.is_file() and "avx512_bf16" in info.read_text()


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON atomically (a temporary file renamed over ``path``)."""
    from composer_trl.lifecycle import dumps

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(data, indent=1) + "\n")
    tmp.replace(path)


def start(args: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``python *args`` as a child process logging to ``log`` (see :func:`finish`)."""
    with log.open("w") as f:
        return subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen[bytes]) -> tuple[int, float]:
    """Wait for a child of :func:`start`: ``(exit code, its peak resident MiB)``."""
    _, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss / 1024.0  # Linux: KiB


def spawn(args: Sequence[str], log: Path) -> tuple[int, float]:
    """Run ``python *args`` as a child process logging to ``log``; ``(exit code, peak resident MiB)``."""
    return finish(start(args, log))


def fill_block(readme: str | Path, begin: str, end: str, block: str) -> None:
    """Replace the text of ``readme`` between the markers ``begin`` and ``end`` with ``block``."""
    text = Path(readme).read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{readme}: no {begin} ... {end} block to fill.")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    Path(readme).write_text(f"{head}{begin}\n{block}{end}{tail}")


def read_cells(folder: Path) -> list[dict[str, Any]]:
    """Every finished cell JSON of ``folder`` (``*.cell.json``), in name order."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.cell.json"))]


# ------------------------------------------------------------------------------------------------ plot

COMPARE_PANELS = (
    ("exact_match", "held-out exact match (greedy)", "exact-match rate"),
    ("partial_credit", "held-out mean partial credit (greedy)", "partial credit"),
)


def plot_comparison(report: Mapping[str, Any], path: str | Path, *, window: int = 10) -> Path:
    """``comparison.json`` as a PNG: per run, the mean over seeds (line) and the min–max band over seeds.

    Panels: held-out exact match, held-out partial credit (at the evaluation points, no smoothing) and the
    training reward (``window``-step moving average per seed, then mean and band). Every run, baselines
    included, is drawn on every panel.
    """
    from composer_trl.plot import _save, require_matplotlib, smooth

    plt = require_matplotlib()
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for i, (name, run) in enumerate(report["runs"].items()):
        color = f"C{i}"
        label = f"{name} (oracle answers: {run['sees_oracle_answers']})"
        for ax, (key, _, _) in zip(axes[:2], COMPARE_PANELS):
            curves = [[(r["step"], r[key]) for r in s["held_out"]] for s in run["seeds"]]
            _band(ax, curves, color, label)
        curves = []
        for s in run["seeds"]:
            pts = [(st, v) for st, v in s["train_reward"] if v is not None]
            if pts:
                steps, vals = zip(*pts)
                curves.append(list(zip(steps, smooth(vals, window))))
        _band(axes[2], curves, color, label)
    n = len(report["seeds"])
    titles = [t for _, t, _ in COMPARE_PANELS] + [f"training reward ({window}-step moving average)"]
    ylabels = [y for _, _, y in COMPARE_PANELS] + ["training reward"]
    for ax, title, ylabel in zip(axes, titles, ylabels):
        ax.set_title(f"{title}; line: mean over {n} seeds, band: min–max", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best", fontsize=7)
    axes[-1].set_xlabel("optimiser step")
    return Path(_save(plt, fig, path))


def _band(ax: Any, curves: Sequence[Sequence[tuple[int, float]]], color: str, label: str) -> None:
    """Mean line and min–max band over curves, at the steps every curve has."""
    if not curves:
        return
    common = sorted(set.intersection(*(set(s for s, _ in c) for c in curves)))
    by = [dict(c) for c in curves]
    vals = [[d[s] for d in by] for s in common]
    mean = [sum(v) / len(v) for v in vals]
    ax.plot(common, mean, color=color, linewidth=1.8, label=label, marker="o" if len(common) < 12 else None)
    ax.fill_between(common, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.2)
