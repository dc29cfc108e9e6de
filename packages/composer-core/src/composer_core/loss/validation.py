"""Shared input checks for the loss functions.

Every check raises :class:`ValueError` that names the offending argument and says how to fix it, so a
bad batch fails loudly at the boundary instead of producing a silent 0 or NaN deep inside a loss.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import ParamSpec, TypeVar

import torch
from torch import Tensor

__all__ = [
    "as_mask",
    "check_bool",
    "check_choice",
    "check_finite",
    "check_int",
    "check_normalizer",
    "check_number",
    "check_probability",
    "check_same_shape",
    "check_tensor",
    "checked_once",
    "host_reads_are_free",
    "value_check",
    "value_checks",
]


# ---------------------------------------------------------------------------------------------------------
# Value checks: eager for a direct call, fused into one host sync inside ``compose_loss``
# ---------------------------------------------------------------------------------------------------------


def host_reads_are_free(device: torch.device) -> bool:
    """CPU tensors are already on the host: reading a count or a flag there costs no stall."""
    return device.type == "cpu"


class _FusedChecks:
    """Conditions collected during one ``compose_loss`` call, read with a single host sync."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.conditions: list[Tensor] = []
        self.messages: list[Callable[[], str]] = []
        self.seen: set[tuple[str, int]] = set()

    def add(
        self, key: tuple[str, int] | None, condition: Callable[[], Tensor], message: Callable[[], str]
    ) -> None:
        if not self.enabled or (key is not None and key in self.seen):
            return
        if key is not None:
            self.seen.add(key)
        self.conditions.append(condition().reshape(()))
        self.messages.append(message)

    def flush(self) -> None:
        """Raise the first failing check's message (in the order the checks were made); one sync if all pass."""
        if not self.conditions:
            return
        device = next(
            (c.device for c in self.conditions if not host_reads_are_free(c.device)),
            self.conditions[0].device,
        )
        ok = torch.stack([c.to(device, non_blocking=True) for c in self.conditions])
        if bool(ok.all()):  # the single host sync of a compose_loss call
            return
        for cond, message in zip(self.conditions, self.messages):
            if not bool(cond):
                raise ValueError(message())


_ACTIVE: ContextVar[_FusedChecks | None] = ContextVar("composer_value_checks", default=None)


@contextmanager
def value_checks(enabled: bool = True) -> Iterator[_FusedChecks]:
    """Collect every value check made inside the block (by any loss function) and run them fused, with one
    host sync, when the block ends normally; ``enabled=False`` drops them (no sync, no extra kernels)."""
    checks = _FusedChecks(enabled)
    token = _ACTIVE.set(checks)
    try:
        yield checks
    finally:
        _ACTIVE.reset(token)
    checks.flush()


_P = ParamSpec("_P")
_R = TypeVar("_R")


def checked_once(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run every value check ``fn`` makes fused, with one host sync when it returns: inside an enclosing
    :func:`value_checks` (``compose_loss``'s) the checks join it instead (no extra sync)."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if _ACTIVE.get() is not None:
            return fn(*args, **kwargs)
        with value_checks():
            return fn(*args, **kwargs)

    return wrapper


def value_check(
    key: tuple[str, int] | None, condition: Callable[[], Tensor], message: Callable[[], str]
) -> None:
    """Require ``condition()`` (a bool tensor) to be all-true, else ``ValueError(message())``.

    Called directly (outside :func:`value_checks`) the check runs at once (one host sync); inside
    ``compose_loss`` it joins the call's fused check. ``key`` (name, id of the tensor) drops a repeated check of
    the same tensor within one call.
    """
    active = _ACTIVE.get()
    if active is not None:
        active.add(key, lambda: condition().all(), message)
        return
    if not bool(condition().all()):
        raise ValueError(message())


def check_tensor(name: str, value: object, *, ndim: int | None = None, min_ndim: int | None = None) -> None:
    """Raise ValueError unless ``value`` is a tensor of the right rank."""
    if not isinstance(value, Tensor):
        raise ValueError(
            f"`{name}` must be a torch.Tensor, got {type(value).__name__}; convert it with torch.as_tensor."
        )
    if ndim is not None and value.dim() != ndim:
        raise ValueError(
            f"`{name}` must have {ndim} dimension(s), got shape {tuple(value.shape)}; reshape it to the documented shape."
        )
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(f"`{name}` must have >= {min_ndim} dimension(s), got shape {tuple(value.shape)}.")


def check_finite(name: str, value: Tensor) -> None:
    """Raise ValueError if ``value`` holds NaN or ±inf."""
    check_tensor(name, value)
    if value.is_floating_point() and value.numel() > 0:
        # detached inside the lambdas: under ``value_checks(enabled=False)`` the check dispatches no op at all
        value_check(
            (name, id(value)),
            lambda: torch.isfinite(value.detach()),
            lambda: (
                f"`{name}` contains {int((~torch.isfinite(value.detach())).sum())} NaN/inf value(s); fix the upstream "
                "computation (e.g. mask padded positions with a finite value instead of -inf/NaN) before "
                "calling the loss."
            ),
        )


def check_float(
    name: str, value: Tensor, *, ndim: int | None = None, min_ndim: int | None = None, values: bool = True
) -> None:
    """Raise ValueError unless ``value`` is a finite floating-point tensor (of the rank, as :func:`check_tensor`);
    ``values=False`` checks the rank and dtype only (a large parameter whose NaN/inf the caller's result check
    catches and names on failure, instead of a scan on every call)."""
    check_tensor(name, value, ndim=ndim, min_ndim=min_ndim)
    if not value.is_floating_point():
        raise ValueError(
            f"`{name}` must be a floating-point tensor, got dtype {value.dtype}; cast it with .float()."
        )
    if values:
        check_finite(name, value)


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
    key = id(mask)
    if mask.dtype != torch.bool:
        check_finite(name, mask)
        raw = mask
        value_check(
            (f"{name}:0/1", key),
            lambda: (raw == 0) | (raw == 1),
            lambda: f"`{name}` must be bool or hold only 0/1 values; binarise it (mask > 0).",
        )
        mask = mask != 0
    if require_nonempty:
        b = mask
        value_check(
            (f"{name}:any", key),
            lambda: b.any(),
            lambda: (
                f"`{name}` selects no token; pass at least one active position, or leave this channel's inputs "
                "out of the batch so it is skipped."
            ),
        )
    return mask


def check_choice(name: str, value: object, choices: Iterable[object]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    options = tuple(choices)
    if value not in options:
        raise ValueError(
            f"`{name}`={value!r} is not supported; choose one of {', '.join(map(repr, options))}."
        )


def check_bool(name: str, value: object) -> None:
    """Raise ValueError unless ``value`` is a bool (a CLI string goes through ``config.coerce_option`` first)."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}`={value!r} must be a bool (True or False).")


def check_int(name: str, value: object, *, low: int) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}`={value!r} must be an int >= {low}.")


def check_probability(name: str, value: float, *, high_open: bool = False) -> float:
    """Raise ValueError unless ``0 <= value <= 1`` (``< 1`` when ``high_open``)."""
    v = float(value)
    if not (v >= 0.0 and (v < 1.0 if high_open else v <= 1.0)):
        raise ValueError(f"`{name}`={value!r} must lie in [0, 1{')' if high_open else ']'}.")
    return v


def check_number(name: str, value: float, *, low: float | None = None, strict: bool = False) -> float:
    """Raise ValueError unless ``value`` is a finite number, ``> low`` (``strict``) or ``>= low``."""
    v = float(value)
    if not math.isfinite(v) or (low is not None and (v < low or (strict and v == low))):
        bound = "" if low is None else f" {'>' if strict else '>='} {low:g}"
        raise ValueError(f"`{name}`={value!r} must be a finite number{bound}.")
    return v


def check_normalizer(name: str, normalizer: float | Tensor | None) -> None:
    """Raise ValueError if a user-supplied normaliser is not a finite positive scalar."""
    if normalizer is None:
        return
    if isinstance(normalizer, Tensor) and normalizer.numel() != 1:
        raise ValueError(f"`{name}` must be a scalar (global count), got shape {tuple(normalizer.shape)}.")
    n = normalizer.detach() if isinstance(normalizer, Tensor) else float(normalizer)

    def message() -> str:
        return (
            f"`{name}`={float(n)!r} must be a finite count > 0 (the global number of tokens/sequences/pairs "
            "summed over micro-batches and ranks)."
        )

    if not isinstance(n, Tensor):
        if not (0.0 < n < float("inf")):
            raise ValueError(message())
        return
    value_check((name, id(normalizer)), lambda: torch.isfinite(n) & (n > 0), message)
