"""``LossInputs`` read and checked for ``composer_loss``: each field's structure on every call (no tensor values
read), then the values (NaN/inf on selected tokens, a 0/1 mask, an overflowing sum) in one fused read per packed
micro-batch: one host read on CPU, asynchronous device asserts on an accelerator."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, NoReturn

import torch
from composer_core.loss.validation import host_reads_are_free as _host_reads_are_free
from torch import Tensor

from composer_prime_rl.contract import read_ref_logprobs


class _Sample(NamedTuple):
    """The fields of a packed micro-batch (or of one sample), detached and zeroed outside ``mask`` (no NaN/inf
    reaches the loss or its gradient); under fresh masks (:class:`_Unmasked`) every token, nothing zeroed."""

    logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    mask: Tensor
    weights: Tensor | None
    # bool per token: ref_logprobs != 0 (a sample of zeros is PRIME-RL's fill); None without ref_logprobs
    ref_nonzero: Tensor | None


class _Suspect(NamedTuple):
    """A packed value check failed (CPU): each sample rechecks its own slice, so the error names the sample
    holding the bad value and a clean sample still trains."""

    raw_mask: Tensor
    mask: Tensor
    named: dict[str, Tensor]
    kept: Tensor


def _tensor(name: str, value: Any, length: int | None, *, floating: bool = True) -> Tensor:
    """A 1-D tensor field of ``length`` tokens (any length when None), floating-point unless ``floating``."""
    if not isinstance(value, Tensor):
        raise ValueError(f"LossInputs.{name} must be a torch.Tensor, got {type(value).__name__}.")
    if value.dim() != 1:
        raise ValueError(
            f"LossInputs.{name} must be 1-D (one sample's tokens; PRIME-RL calls the loss once per "
            f"sample), got shape {tuple(value.shape)}."
        )
    if length is not None and value.shape[0] != length:
        raise ValueError(
            f"LossInputs.{name} has {value.shape[0]} tokens but trainer_logprobs has {length}; "
            "every per-token field must have the same length."
        )
    if floating and not value.is_floating_point():
        raise ValueError(f"LossInputs.{name} must be a floating-point tensor, got {value.dtype}.")
    return value


def _fields(inputs: Any, sdpo: bool) -> tuple[Tensor, dict[str, Tensor]]:
    """Structural checks (no tensor values read): (raw mask, the float fields by name, trainer log-probs first,
    ref_logprobs last when channel 2 (``sdpo``) reads them)."""
    n = _tensor("trainer_logprobs", getattr(inputs, "trainer_logprobs", None), None).shape[0]
    names = ("trainer_logprobs", "inference_logprobs", "advantages")
    named = {name: _tensor(name, getattr(inputs, name, None), n) for name in names}
    raw_mask = _tensor("loss_mask", getattr(inputs, "loss_mask", None), n, floating=False)
    ref = read_ref_logprobs(inputs)
    # loss_weights: absent before PRIME-RL 0be5ac45 (None = 1.0)
    optional = {
        "loss_weights": getattr(inputs, "loss_weights", None),
        "ref_logprobs": ref if sdpo else None,
    }
    named |= {name: _tensor(name, value, n) for name, value in optional.items() if value is not None}
    return raw_mask, named


_NOT_BOOLEAN = "LossInputs.loss_mask must be boolean (or 0/1); it has other values."
_NON_FINITE = (
    "LossInputs.{name} has NaN or inf on tokens selected by loss_mask; fix the producer of this field "
    "(values outside loss_mask are ignored)."
)
_OVERFLOW = (
    "LossInputs fields are finite but so large that their sum over loss_mask overflows {dtype}; check the "
    "advantages' scale (values outside loss_mask are ignored)."
)


def _raise_bad_values(binary: Tensor | None, mask: Tensor, named: dict[str, Tensor]) -> NoReturn:
    """The fused check failed: name the first culprit (extra reads only on this error path)."""
    if binary is not None and not bool(binary):
        raise ValueError(_NOT_BOOLEAN)
    for name, t in named.items():
        if not bool((torch.isfinite(t) | ~mask).all()):
            raise ValueError(_NON_FINITE.format(name=name))
    raise ValueError(_OVERFLOW.format(dtype=named["trainer_logprobs"].dtype))


def _passes(total: Tensor, binary: Tensor | None, named: dict[str, Tensor], kept: Tensor) -> bool:
    """Whether every value check passes: ``total`` (the sum of every kept value) is non-finite exactly when a
    selected token holds NaN/±inf (or the sum overflows); ``binary``: whether a non-bool mask is 0/1 (None for a
    bool mask). On CPU one host read; on an accelerator True, after queueing one asynchronous device assert per
    field (no host sync), which fails at the next synchronisation with the message naming the field."""
    if _host_reads_are_free(kept.device):
        if binary is not None:  # one read either way: a non-binary mask turns the total into NaN
            total = torch.where(binary, total, math.nan)
        return math.isfinite(total.item())
    # x − x is 0 for a finite x and NaN for NaN/±inf: a field's row sums to 0 exactly when its kept values are finite
    ok = total.sub(total).eq(0)
    if binary is not None:
        ok &= binary
    finite = kept.sub(kept).sum(dim=1).eq(0)  # per field, exact (kept is 0 outside the mask)
    for flag, name in zip(finite.unbind(), named, strict=True):
        torch._assert_async(flag, _NON_FINITE.format(name=name))
    if binary is not None:
        torch._assert_async(binary, _NOT_BOOLEAN)
    torch._assert_async(ok, _OVERFLOW.format(dtype=kept.dtype))
    return True


def _bool_mask(raw_mask: Tensor, device: torch.device) -> Tensor:
    """The mask as bool on ``device`` (itself when it already is)."""
    return (raw_mask if raw_mask.dtype == torch.bool else raw_mask != 0).to(device)


def _check(kept: Tensor, raw_mask: Tensor, mask: Tensor, named: dict[str, Tensor]) -> None:
    """One sample's value checks (:func:`_passes`) on its fields ``kept`` [F, n] (zeroed outside ``mask``)."""
    binary = _binary(raw_mask, kept.device)
    if not _passes(kept.sum(), binary, named, kept):
        _raise_bad_values(binary, mask, named)


def _binary(raw_mask: Tensor, device: torch.device) -> Tensor | None:
    """Whether a non-bool mask holds only 0 and 1 (0-dim bool on ``device``; None for a bool mask)."""
    return None if raw_mask.dtype == torch.bool else ((raw_mask == 0) | (raw_mask == 1)).all().to(device)


def _as_sample(named: dict[str, Tensor], kept: Tensor, mask: Tensor, stacked: Tensor) -> _Sample:
    """The fields ``kept`` [F, N] by name. PRIME-RL's packer fills ref_logprobs with 0.0 when a sample has none
    but a neighbour in its micro-batch has some: that is no teacher, so channel 2 is skipped for such a sample
    (decided per sample from its count of ``ref_nonzero`` flags, with no branch on tensor values)."""
    by_name = dict(zip(named, kept.unbind(0), strict=True))
    return _Sample(
        logprobs=by_name["trainer_logprobs"],
        inference_logprobs=by_name["inference_logprobs"],
        ref_logprobs=by_name.get("ref_logprobs"),
        advantages=by_name["advantages"],
        mask=mask,
        weights=by_name.get("loss_weights"),
        ref_nonzero=stacked[-1] != 0 if "ref_logprobs" in named else None,
    )


def _read(raw_mask: Tensor | None, named: dict[str, Tensor]) -> tuple[_Sample, Tensor, _Suspect | None]:
    """(the sample, the stacked fields [F, N], the suspect: None when the fused check (:func:`_passes`) passed).
    ``raw_mask`` None (fresh masks, :class:`_Unmasked`): every token, nothing zeroed nor checked yet."""
    logprobs = named[
        "trainer_logprobs"
    ]  # [F, N] every field in its dtype and device, detached (a new tensor)
    stacked = torch.stack([_as(t, logprobs.device, logprobs.dtype) for t in named.values()])
    if raw_mask is None:
        every = torch.ones(stacked.shape[1], dtype=torch.bool, device=stacked.device)
        return _as_sample(named, stacked, every, stacked), stacked, None
    mask = _bool_mask(raw_mask, stacked.device)
    kept = _keep(mask, stacked)  # every field detached, zeroed outside the mask
    passed = _passes(kept.sum(), _binary(raw_mask, stacked.device), named, kept)
    return (
        _as_sample(named, kept, mask, stacked),
        stacked,
        None if passed else _Suspect(raw_mask, mask, named, kept),
    )


# torch.where's CPU kernel is a scalar loop: from this many tokens on its vectorised equivalents win
VECTORISED_FROM = 16384
# An integer dtype of each float dtype's width: a float's bits ANDed with 0 or all ones is +0.0 or itself.
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def _vectorised(mask: Tensor) -> bool:
    return mask.device.type == "cpu" and mask.shape[-1] >= VECTORISED_FROM


def _keep(mask: Tensor, x: Tensor) -> Tensor:
    """``torch.where(mask, x, 0)``, exact for NaN/inf outside the mask: on many tokens a bitwise AND of the bits."""
    ints = _BITS.get(x.dtype)
    if ints is None or not _vectorised(mask):
        return torch.where(mask, x, _zero(x))
    return (x.view(ints) & mask.to(ints).neg_()).view(x.dtype)


def _as(t: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``t`` on ``device`` in ``dtype`` (itself when it already is: no dispatch)."""
    return t if t.dtype == dtype and t.device == device else t.to(device=device, dtype=dtype)


def _bits(t: Tensor) -> Tensor:
    """A bool tensor of many tokens as a 0/1 uint8 view (CPU kernels reading bool as a float are scalar loops);
    any other tensor as itself."""
    return t.view(torch.uint8) if t.dtype == torch.bool and _vectorised(t) else t


def _zero(like: Tensor) -> Tensor:
    """A 0-dim zero of ``like``'s dtype and device, made once (``where(c, x, 0.0)`` makes one per call)."""
    return _zero_of(like.dtype, like.device)


@functools.cache
def _zero_of(dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.zeros((), dtype=dtype, device=device)


def finite_on_host(a: Tensor, b: Tensor) -> bool:
    """Whether every value of ``a`` and ``b`` is finite, known by one host read on CPU only (else False)."""
    return _host_reads_are_free(a.device) and math.isfinite((a.sum() + b.sum()).item())
