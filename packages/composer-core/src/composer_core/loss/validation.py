"""Shared input checks for the loss functions.

Every check raises :class:`ValueError` that names the offending argument and says how to fix it, so a
bad batch fails loudly at the boundary instead of producing a silent 0 or NaN deep inside a loss.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "as_mask",
    "check_choice",
    "check_finite",
    "check_normalizer",
    "check_probability",
    "check_same_shape",
    "check_tensor",
    "resolve_normalizer",
]


def check_tensor(name: str, value: object, *, ndim: int | None = None, min_ndim: int | None = None) -> Tensor:
    """Return ``value`` if it is a floating/bool/int tensor of the right rank, else raise ValueError."""
    if not isinstance(value, Tensor):
        raise ValueError(
            f"`{name}` must be a torch.Tensor, got {type(value).__name__}; convert it with torch.as_tensor."
        )
    if ndim is not None and value.dim() != ndim:
        raise ValueError(
            f"`{name}` must have {ndim} dimension(s), got shape {tuple(value.shape)}; reshape it to the documented shape."
        )
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(
            f"`{name}` must have at least {min_ndim} dimension(s), got shape {tuple(value.shape)}."
        )
    return value


def check_finite(name: str, value: Tensor) -> Tensor:
    """Raise ValueError if ``value`` holds NaN or ±inf."""
    check_tensor(name, value)
    if value.is_floating_point() and value.numel() > 0 and not bool(torch.isfinite(value.detach()).all()):
        n_bad = int((~torch.isfinite(value.detach())).sum())
        raise ValueError(
            f"`{name}` contains {n_bad} NaN/inf value(s); fix the upstream computation (e.g. mask padded "
            "positions with a finite value instead of -inf/NaN) before calling the loss."
        )
    return value


def check_float(name: str, value: Tensor) -> Tensor:
    """Raise ValueError unless ``value`` is a finite floating-point tensor."""
    check_tensor(name, value)
    if not value.is_floating_point():
        raise ValueError(
            f"`{name}` must be a floating-point tensor, got dtype {value.dtype}; cast it with .float()."
        )
    return check_finite(name, value)


def check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    """Raise ValueError if the two tensors differ in shape."""
    if a.shape != b.shape:
        raise ValueError(
            f"`{name_b}` has shape {tuple(b.shape)} but `{name_a}` has shape {tuple(a.shape)}; they must match "
            "(same batch, length and, for logits, the same vocabulary)."
        )


def as_mask(
    name: str,
    mask: Tensor | None,
    shape: torch.Size | tuple[int, ...],
    *,
    device: torch.device,
    require_nonempty: bool = True,
) -> Tensor:
    """Validate a bool or 0/1 mask of ``shape`` and return it as a bool tensor (all-True when ``None``)."""
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    check_tensor(name, mask)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(
            f"`{name}` has shape {tuple(mask.shape)} but must have shape {tuple(shape)} (one entry per token)."
        )
    if mask.dtype != torch.bool:
        check_finite(name, mask)
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"`{name}` must be bool or hold only 0/1 values; binarise it (mask > 0).")
        mask = mask != 0
    if require_nonempty and not bool(mask.any()):
        raise ValueError(
            f"`{name}` selects no token; pass at least one active position, or leave this channel's inputs "
            "out of the batch so it is skipped."
        )
    return mask


def check_choice(name: str, value: object, choices: Iterable[object]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    options = tuple(choices)
    if value not in options:
        raise ValueError(
            f"`{name}`={value!r} is not supported; choose one of {', '.join(map(repr, options))}."
        )


def check_probability(
    name: str,
    value: float,
    *,
    low: float = 0.0,
    high: float = 1.0,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Raise ValueError unless ``low <(=) value <(=) high``."""
    v = float(value)
    ok_low = v > low if low_open else v >= low
    ok_high = v < high if high_open else v <= high
    if not (ok_low and ok_high) or v != v:
        lb = "(" if low_open else "["
        hb = ")" if high_open else "]"
        raise ValueError(f"`{name}`={value!r} must lie in {lb}{low}, {high}{hb}.")
    return v


def check_positive(name: str, value: float) -> float:
    """Raise ValueError unless ``value`` is a finite number > 0."""
    v = float(value)
    if not (v > 0.0) or v == float("inf"):
        raise ValueError(f"`{name}`={value!r} must be a finite number > 0.")
    return v


def check_normalizer(name: str, normalizer: float | Tensor | None) -> None:
    """Raise ValueError if a user-supplied normaliser is not a finite positive scalar."""
    if normalizer is None:
        return
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1:
            raise ValueError(
                f"`{name}` must be a scalar (global count), got shape {tuple(normalizer.shape)}."
            )
        check_finite(name, normalizer.float())
        val = float(normalizer.detach())
    else:
        val = float(normalizer)
    if not (val > 0.0) or val == float("inf"):
        raise ValueError(
            f"`{name}`={val!r} must be a finite count > 0 (the global number of tokens/sequences/pairs "
            "summed over micro-batches and ranks)."
        )


def resolve_normalizer(name: str, normalizer: float | Tensor | None, local_count: Tensor) -> Tensor | float:
    """The denominator: ``normalizer`` if given (validated), else ``local_count.clamp(min=1)``."""
    if normalizer is None:
        return local_count.clamp(min=1)
    check_normalizer(name, normalizer)
    return normalizer


def check_no_extra(name: str, extra: Mapping[str, Any]) -> None:
    """Raise ValueError for unknown keyword options."""
    if extra:
        raise ValueError(
            f"{name}() got unknown option(s) {sorted(extra)}; check the spelling against the docs."
        )
