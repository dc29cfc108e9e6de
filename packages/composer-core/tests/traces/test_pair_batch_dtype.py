"""``sequence_logps`` keeps float64 logits in float64 (issue 50); low-precision logits are summed in float32."""

from __future__ import annotations

import pytest
import torch
from composer_core.traces.pair_batch import sequence_logps


def _case(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50)
    logits = (torch.randn(3, 5, 7, generator=g, dtype=torch.float64) * 3).to(dtype)
    ids = torch.randint(0, 7, (3, 5), generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    return logits, ids, mask


def test_float64_logits_give_a_float64_sum_equal_to_the_closed_form() -> None:
    logits, ids, mask = _case()
    out = sequence_logps(logits, ids, mask)
    assert out.dtype == torch.float64
    # independent: log p(y) = z_y − log Σ_v exp(z_v), summed over the selected tokens, in float64
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    want = ((picked - torch.logsumexp(logits, dim=-1)) * mask.double()).sum(-1)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_gradcheck_float64() -> None:
    logits, ids, mask = _case()
    assert torch.autograd.gradcheck(lambda z: sequence_logps(z, ids, mask), (logits.requires_grad_(True),))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_logits_are_summed_in_float32(dtype: torch.dtype) -> None:
    logits, ids, mask = _case(dtype)
    out = sequence_logps(logits, ids, mask)
    assert out.dtype == torch.float32
    z = logits.double()
    want = ((z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)) * mask.double()).sum(
        -1
    )
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
