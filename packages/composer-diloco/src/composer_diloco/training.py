"""A plain training-loop helper: the ordinary ``zero_grad(); backward(); step()`` loop inside
torchft's DiLoCo context, with a progress bar, stopping after a number of outer syncs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .diloco import DiLoCoConfig, build_diloco


@dataclass
class TrainStats:
    """What :func:`train_diloco` did."""

    inner_steps: int = 0
    syncs: int = 0
    losses: list[float] = field(default_factory=list)


def train_diloco(
    model: nn.Module,
    inner_optimizer: torch.optim.Optimizer,
    manager: Any,
    config: DiLoCoConfig,
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    max_syncs: int | None = None,
    fragments: Sequence[nn.Module] | None = None,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainStats:
    """Train with DiLoCo until ``batches`` runs out or ``manager.current_step()`` (committed syncs, the
    global step: a healed replica stops with the others) reaches ``max_syncs``. ``loss_fn(model, batch)``
    returns a scalar loss."""
    if max_syncs is not None and (not isinstance(max_syncs, int) or max_syncs < 1):
        raise ValueError(f"max_syncs must be a positive int or None, got {max_syncs!r}.")
    stats = TrainStats()
    diloco = build_diloco(
        manager, list(fragments) if fragments is not None else model, inner_optimizer, config
    )
    bar = tqdm(total=max_syncs, desc="diloco syncs", disable=not progress, leave=False)
    with diloco:
        for batch in batches:
            if max_syncs is not None and manager.current_step() >= max_syncs:
                break
            inner_optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}.")
            if not torch.isfinite(loss):
                raise ValueError(
                    f"loss is {loss.item()} at inner step {stats.inner_steps}; stopping before it spreads."
                )
            loss.backward()  # type: ignore[no-untyped-call]
            inner_optimizer.step()  # DiLoCo's hooks sync here every sync_every / n_fragments steps
            stats.inner_steps += 1
            stats.losses.append(float(loss.detach()))
            bar.update(manager.current_step() - bar.n)
            if on_step is not None:
                on_step(stats.inner_steps, stats.losses[-1])
    bar.close()
    stats.syncs = manager.current_step()
    return stats
