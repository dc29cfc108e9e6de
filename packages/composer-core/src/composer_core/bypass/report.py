"""End-of-run reporting: per-block loss table, history JSON and a PNG plot (extra ``plot``)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def loss_table(history: Sequence[dict[str, Any]], validation: Sequence[dict[str, Any]] = ()) -> str:
    """Fixed-width table: block, loss at the first and last step, last validation loss."""
    if not history:
        return "(no training steps recorded)"
    first, last = history[0]["block_loss"], history[-1]["block_loss"]
    val = validation[-1]["block_loss"] if validation else {}
    lines = [
        f"{'block':>5}  {'first step':>12}  {'step ' + str(history[-1]['step']):>12}  {'validation':>12}"
    ]
    for key in sorted(last, key=int):
        v = f"{val[key]:12.6f}" if key in val else f"{'-':>12}"
        lines.append(f"{key:>5}  {first[key]:12.6f}  {last[key]:12.6f}  {v}")
    if validation:
        lines.append(
            f"assembled student LM loss (step {validation[-1]['step']}): {validation[-1]['lm_loss']:.6f}"
        )
    return "\n".join(lines)


def plot_block_losses(history: Sequence[dict[str, Any]], path: str | Path, *, title: str = "bypass") -> Path:
    """Per-block training loss over steps (log scale) as a PNG."""
    if not history:
        raise ValueError("no history to plot: the run recorded no steps")
    try:
        importlib.import_module("matplotlib").use("Agg")
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'composer-core[plot]'") from exc
    plt: Any = importlib.import_module("matplotlib.pyplot")
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    for key in sorted(history[0]["block_loss"], key=int):
        ax.plot(steps, [max(h["block_loss"][key], 1e-12) for h in history], label=f"block {key}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("normalised block loss")
    ax.set_title(title)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
