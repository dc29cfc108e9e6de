"""PNG plot of a ``composer-train`` run: reward and each channel's loss per step (matplotlib, ``[plot]`` extra)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PANELS = (
    ("reward", "reward (mean over completions)", "training reward"),
    ("composer/loss/policy", "channel 1: policy loss", "policy loss"),
    ("composer/loss/sdpo", "channel 2: SDPO (hinted self-distillation)", "SDPO loss"),
    ("composer/loss/replay", "channel 3: trace replay (preference)", "replay loss"),
)


def require_matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'composer-trl[plot]'") from e
    return plt


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (the first points average over what exists so far)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_runs(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, *, window: int = 10) -> Path:
    """Plot each run's metrics rows (from :func:`composer_trl.progress.read_jsonl`) into one PNG.

    ``runs`` maps a label ("composer", "GRPO alone") to its rows; a panel is drawn for reward and every
    channel-loss metric that any run logged. Light lines are raw values, solid lines a ``window``-step
    moving average. Returns the PNG path.
    """
    plt = require_matplotlib()
    panels = [p for p in PANELS if any(p[0] in row for rows in runs.values() for row in rows)]
    if not panels:
        raise ValueError("no metrics to plot: the runs logged neither reward nor channel losses.")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (key, title, ylabel) in zip(axes[:, 0], panels):
        for i, (label, rows) in enumerate(runs.items()):
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if not pts:
                continue
            steps, vals = zip(*pts)
            color = f"C{i}"
            ax.plot(steps, vals, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, smooth(vals, window), color=color, linewidth=1.8, label=label)
        ax.set_title(f"{title} (light: per step; solid: {window}-step moving average)", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("optimiser step")
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
