"""Per-block optimisers, loss scaling, clipping and the learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

ClipMode = Literal["none", "norm", "value"]


def cosine_lr(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup then cosine decay to a floor (Loshchilov & Hutter 2017, SGDR).

    ``step < warmup``: ``lr·(step+1)/warmup``; after: ``min_lr + ½(lr − min_lr)(1 + cos(π·p))``
    with ``p = (step − warmup)/(total − warmup)`` clamped to [0, 1]. ``step`` counts
    optimiser steps already taken (0 for the first).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= min_lr <= lr:
        raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={min_lr}, lr={lr}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass
class BlockOptimizer:
    """One student block's AdamW and GradScaler (each block steps independently)."""

    index: int
    params: list[nn.Parameter]
    optimizer: torch.optim.AdamW
    scaler: torch.amp.GradScaler

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])


def make_block_optimizer(
    index: int,
    params: list[nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    loss_scaling: bool,
    init_scale: float,
    device: str = "cpu",
) -> BlockOptimizer:
    """AdamW (Loshchilov & Hutter 2019, fused kernel) over one block's trainable parameters."""
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale, enabled=loss_scaling)
    return BlockOptimizer(index, params, opt, scaler)


def optimizer_step(block: BlockOptimizer, *, lr: float, clip: ClipMode, clip_value: float) -> float:
    """One step in Puzzletron's order: ``unscale_`` → clip → ``scaler.step`` → ``update`` → ``zero_grad``.

    Clipping runs on the unscaled gradients (clipping scaled ones would shrink the
    threshold by the loss scale). Returns the unscaled gradient norm before clipping.
    """
    for group in block.optimizer.param_groups:
        group["lr"] = lr
    block.scaler.unscale_(block.optimizer)
    grads = [p for p in block.params if p.grad is not None]
    norm = float(torch.nn.utils.clip_grad_norm_(grads, clip_value if clip == "norm" else math.inf))
    if clip == "value":
        torch.nn.utils.clip_grad_value_(grads, clip_value)
    block.scaler.step(block.optimizer)
    block.scaler.update()
    block.optimizer.zero_grad(set_to_none=True)
    return norm
