"""A thin entry point around torchft's DiLoCo (``torchft.local_sgd.DiLoCo``).

DiLoCo (Douillard et al., arXiv 2311.08105): each replica runs H inner steps from the global θ to θ_i;
the replicas exchange the pseudo-gradient ``Δ = (1/k) Σ_i (θ − θ_i)`` and the outer optimiser takes it as
a gradient, ``θ ← OuterOpt(θ, Δ)`` (SGD-Nesterov: ``b ← μ b + Δ ; θ ← θ − η (Δ + μ b)``; η = 1, μ = 0 is
parameter averaging). Streaming DiLoCo (arXiv 2501.18512) syncs strided fragments on staggered schedules,
overlaps an exchange with τ inner steps and merges ``θ_local ← lerp(θ_global_new, θ_local, α)``.
:func:`build_diloco` validates a :class:`DiLoCoConfig` and hands everything to torchft's own class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DiLoCoConfig:
    """DiLoCo / Streaming DiLoCo hyper-parameters.

    Args:
        sync_every: H, inner optimiser steps per full outer round (every fragment synced once).
        outer_lr: η of the outer SGD (paper: 0.7).
        outer_momentum: μ of the outer SGD (paper: 0.9).
        nesterov: Nesterov momentum for the outer SGD (paper: True; needs μ > 0).
        n_fragments: Streaming DiLoCo fragment count (1 = vanilla DiLoCo).
        fragment_sync_delay: τ, inner steps a fragment's exchange may overlap (< H / n_fragments).
        fragment_update_alpha: α of the merge ``lerp(global_new, local, α)`` in [0, 1].
        should_quantize: exchange quantised pseudo-gradients (torchft: fp8 via triton on GPU,
            ignored by torchft on CPU; :class:`~composer_diloco.ObjectStoreManager`: fp8 e4m3
            with a per-tensor scale on every device).
        use_bucketization: all-reduce flat buckets instead of one call per parameter.
        bucket_cap_mb: bucket size when ``use_bucketization``.
        backup_device: where torchft keeps the global copy (default CPU).
        pin_memory: pin the CPU backup (only matters with an accelerator).
    """

    sync_every: int = 500
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    n_fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    should_quantize: bool = False
    use_bucketization: bool = False
    bucket_cap_mb: int | None = None
    backup_device: str | None = None
    pin_memory: bool = True

    def __post_init__(self) -> None:
        _check_int("sync_every", self.sync_every, minimum=1)
        _check_int("n_fragments", self.n_fragments, minimum=1)
        _check_int("fragment_sync_delay", self.fragment_sync_delay, minimum=0)
        if self.sync_every % self.n_fragments != 0:
            raise ValueError(
                f"sync_every={self.sync_every} must be a multiple of n_fragments={self.n_fragments}: "
                "each fragment is synced every sync_every / n_fragments inner steps."
            )
        per_fragment = self.sync_every // self.n_fragments
        if self.fragment_sync_delay >= per_fragment:
            raise ValueError(
                f"fragment_sync_delay={self.fragment_sync_delay} must be < sync_every / n_fragments "
                f"= {per_fragment}: a fragment must be synced before it is reduced again."
            )
        for name in ("outer_lr", "outer_momentum", "fragment_update_alpha"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}.")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}.")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0; pass nesterov=False for plain SGD.")
        if not 0 <= self.fragment_update_alpha <= 1:
            raise ValueError(f"fragment_update_alpha must be in [0, 1], got {self.fragment_update_alpha}.")
        if self.bucket_cap_mb is not None and (
            not isinstance(self.bucket_cap_mb, int) or self.bucket_cap_mb < 1
        ):
            raise ValueError(f"bucket_cap_mb must be a positive int or None, got {self.bucket_cap_mb!r}.")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DiLoCoConfig:
        """Build from a mapping, rejecting unknown keys by name."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown DiLoCoConfig keys {unknown}; known keys: {sorted(known)}.")
        return cls(**values)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


def split_fragments(model: nn.Module, n_fragments: int) -> list[nn.Module]:
    """Split a model's blocks (its top-level children with parameters; for a transformer pass the layer
    list) into ``n_fragments`` *strided* fragments: block j goes to fragment ``j % n_fragments``."""
    _check_int("n_fragments", n_fragments, minimum=1)
    if n_fragments == 1:
        return [model]
    blocks = [m for m in model.children() if any(True for _ in m.parameters())]
    if len(blocks) < n_fragments:
        raise ValueError(
            f"n_fragments={n_fragments} but the model has only {len(blocks)} top-level blocks with "
            "parameters; pass fewer fragments or a module whose children are the blocks."
        )
    owned = {id(p) for b in blocks for p in b.parameters()}
    stray = [n for n, p in model.named_parameters() if id(p) not in owned]
    if stray:
        raise ValueError(f"parameters {stray} belong to no top-level block; wrap them in a child module.")
    return [nn.ModuleList(blocks[i::n_fragments]) for i in range(n_fragments)]


def make_outer_optimizers(
    fragments: Sequence[nn.Module], config: DiLoCoConfig
) -> list[torch.optim.Optimizer]:
    """One outer ``SGD(lr=η, momentum=μ, nesterov=…)`` per fragment (created once: it keeps momentum)."""
    return [
        torch.optim.SGD(
            list(f.parameters()), lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.nesterov
        )
        for f in fragments
    ]


def build_diloco(
    manager: Any,
    model: nn.Module | Sequence[nn.Module],
    inner_optimizer: torch.optim.Optimizer,
    config: DiLoCoConfig,
    *,
    outer_optimizers: Sequence[torch.optim.Optimizer] | None = None,
) -> Any:
    """Return ``torchft.local_sgd.DiLoCo`` configured by ``config``.

    Args:
        manager: a ``torchft.Manager`` built with ``use_async_quorum=False`` (see
            :func:`composer_diloco.fault_tolerant.make_manager`) or a
            :class:`composer_diloco.ObjectStoreManager`.
        model: the model (split into ``config.n_fragments`` strided fragments) or an explicit
            list of fragments.
        inner_optimizer: any ``torch.optim.Optimizer`` over the model's parameters (AdamW in
            the paper); DiLoCo hooks its ``step``.
        outer_optimizers: override the default outer SGD-Nesterov (one per fragment).

    Use it as a context manager around the ordinary loop
    ``zero_grad(); loss.backward(); inner_optimizer.step()``.
    """
    from torchft.local_sgd import DiLoCo

    if getattr(manager, "_use_async_quorum", False):
        raise ValueError(
            "DiLoCo needs a synchronous quorum: build the torchft Manager with use_async_quorum=False "
            "(composer_diloco.fault_tolerant.make_manager does)."
        )
    if isinstance(model, nn.Module):
        fragments = split_fragments(model, config.n_fragments)
    else:
        fragments = list(model)
        if len(fragments) != config.n_fragments:
            raise ValueError(
                f"got {len(fragments)} fragments but config.n_fragments={config.n_fragments}; make them agree."
            )
    frag_params = {id(p) for f in fragments for p in f.parameters()}
    opt_params = {id(p) for g in inner_optimizer.param_groups for p in g["params"]}
    if not frag_params:
        raise ValueError("the model has no parameters to synchronise.")
    if not frag_params <= opt_params:
        raise ValueError(
            "inner_optimizer does not optimise every model parameter; DiLoCo would sync parameters "
            "that never move. Build the inner optimiser over model.parameters()."
        )
    outer = make_outer_optimizers(fragments, config) if outer_optimizers is None else list(outer_optimizers)
    if len(outer) != len(fragments):
        raise ValueError(f"need one outer optimiser per fragment ({len(fragments)}), got {len(outer)}.")
    passed = ("sync_every", "pin_memory", "use_bucketization", "bucket_cap_mb", "should_quantize")
    kw = {k: getattr(config, k) for k in (*passed, "fragment_sync_delay", "fragment_update_alpha")}
    backup = torch.device(config.backup_device) if config.backup_device else None
    return DiLoCo(manager, fragments, inner_optimizer, outer, backup_device=backup, **kw)
