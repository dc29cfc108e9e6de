import pytest
import torch
from composer_core.bypass.losses import (
    get_loss,
    normalized_mse,
    per_sample_normalized_mse,
    vectorwise_normalized_mse,
)

LOSSES = [normalized_mse, vectorwise_normalized_mse, per_sample_normalized_mse]


def test_normalized_mse_closed_form() -> None:
    y = torch.tensor([[[3.0, 4.0]], [[0.0, 1.0]]])  # Σy² = 26 over 4 elements
    x = torch.tensor([[[3.0, 2.0]], [[1.0, 1.0]]])  # Σ(x−y)² = 4 + 1 = 5
    assert normalized_mse(x, y, eps=0.0).item() == pytest.approx(5 / 26)
    # token vectors: (4/25 + 1/1)/2 ; samples are single tokens here, so per-sample is the same
    assert vectorwise_normalized_mse(x, y, eps=0.0).item() == pytest.approx((4 / 25 + 1) / 2)
    assert per_sample_normalized_mse(x, y, eps=0.0).item() == pytest.approx((4 / 25 + 1) / 2)


def test_per_sample_differs_from_vectorwise() -> None:
    y = torch.tensor([[[1.0, 0.0], [0.0, 3.0]]])  # one sample, two tokens
    x = torch.tensor([[[0.0, 0.0], [0.0, 3.0]]])
    assert per_sample_normalized_mse(x, y, eps=0.0).item() == pytest.approx(1 / 10)
    assert vectorwise_normalized_mse(x, y, eps=0.0).item() == pytest.approx((1 + 0) / 2)


def test_eps_stabilises_zero_target() -> None:
    y = torch.zeros(2, 3, 4)
    x = torch.ones(2, 3, 4)
    assert normalized_mse(x, y, eps=0.5).item() == pytest.approx(1 / 0.5)


@pytest.mark.parametrize("fn", LOSSES)
def test_identical_outputs_give_zero(fn) -> None:  # type: ignore[no-untyped-def]
    y = torch.randn(2, 5, 8)
    assert fn(y.clone(), y).item() == 0.0


@pytest.mark.parametrize("fn", LOSSES)
def test_gradcheck_float64(fn) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 3, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a: fn(a, y, 1e-6), (x,))


@pytest.mark.parametrize("fn", LOSSES)
def test_bad_inputs(fn) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="shape"):
        fn(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="teacher block output contains NaN/inf"):
        fn(torch.zeros(2, 3, 4), torch.full((2, 3, 4), float("nan")))
    y = torch.ones(2, 3, 4)
    y[0, 1, 2] = float("inf")
    with pytest.raises(ValueError, match="teacher block output contains NaN/inf"):
        fn(torch.zeros(2, 3, 4), y)
    x = torch.zeros(2, 3, 4)
    x[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="student block output contains NaN/inf"):
        fn(x, torch.ones(2, 3, 4))


def test_get_loss_unknown() -> None:
    assert get_loss("vectorwise") is vectorwise_normalized_mse
    with pytest.raises(ValueError, match="loss='l1'"):
        get_loss("l1")
