"""Shared fixtures: build one PRIME-RL sample (``LossInputs``) from plain lists."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from composer_prime_rl import LossInputs

MakeInputs = Callable[..., Any]

# One sample's tensors are tiny: intra-op threads only add contention (a 2-core CI runner
# shared with other jobs spends milliseconds per op waking them).
torch.set_num_threads(1)


def _t(values: Sequence[float] | torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if values is None or isinstance(values, torch.Tensor):
        return values
    return torch.tensor(list(values), dtype=dtype)


@pytest.fixture
def make_inputs() -> MakeInputs:
    """Factory: ``make_inputs(p_train=[...], p_inf=[...], adv=[...], ...)`` -> LossInputs.

    Probabilities (``p_*``) or log-probs (``lp_*``) of the sampled tokens; trainer log-probs
    are a leaf with ``requires_grad``. The mask defaults to all tokens.
    """

    def make(
        *,
        p_train: Sequence[float] | None = None,
        p_inf: Sequence[float] | None = None,
        p_ref: Sequence[float] | None = None,
        lp_train: Sequence[float] | torch.Tensor | None = None,
        lp_inf: Sequence[float] | torch.Tensor | None = None,
        lp_ref: Sequence[float] | torch.Tensor | None = None,
        adv: Sequence[float] | torch.Tensor,
        mask: Sequence[bool] | torch.Tensor | None = None,
        weights: Sequence[float] | torch.Tensor | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> Any:
        if p_train is not None:
            lp_train = [math.log(p) for p in p_train]
        if p_inf is not None:
            lp_inf = [math.log(p) for p in p_inf]
        if p_ref is not None:
            lp_ref = [math.log(p) for p in p_ref]
        train = _t(lp_train, dtype)
        assert train is not None
        if not train.requires_grad:
            train = train.clone().requires_grad_(True)
        n = train.shape[0]
        m = torch.ones(n, dtype=torch.bool) if mask is None else torch.as_tensor(mask, dtype=torch.bool)
        return LossInputs(
            trainer_logprobs=train,
            inference_logprobs=_t(lp_inf, dtype),
            ref_logprobs=_t(lp_ref, dtype),
            advantages=_t(adv, dtype),
            loss_mask=m,
            loss_weights=_t(weights, dtype),
        )

    return make


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[str]]:
    """Call it to start recording every read of a tensor value to the host (``item``, ``bool``, ``float``,
    ``int``, ``index``, ``tolist``): the returned list fills as they happen; ``monkeypatch.undo()`` stops it."""

    def start() -> list[str]:
        calls: list[str] = []
        for name in ("item", "__bool__", "__float__", "__int__", "__index__", "tolist"):
            orig = getattr(torch.Tensor, name)

            def wrapper(self: torch.Tensor, *a: object, _orig=orig, _name=name, **k: object) -> object:  # type: ignore[no-untyped-def]
                calls.append(_name)
                return _orig(self, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapper)
        return calls

    return start
