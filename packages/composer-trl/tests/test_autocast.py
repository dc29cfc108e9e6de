"""Channel 2 under mixed precision: one real TRL training step with ``bf16=True`` (TRL's default on CPU:
accelerate runs the model forward under CPU bf16 autocast; Qwen2's final norm returns the float32 residual
stream's dtype, so the hidden states reach the loss in float32) and with
``compute_loss`` itself under CPU bf16 autocast (``compute_loss_context_manager``, as transformers versions
that autocast there and FSDP mixed-precision setups do).

Inside the step, the adapter's loss assembly (:func:`composer_trl.loss.composer_trl_loss`) is re-run on leaf
copies of the batch the trainer built, once under the ambient autocast and once with autocast off in float32:
value and gradients must agree to float32 rounding (the fused LM-head loss used to raise ``mat1 and mat2
must have the same dtype`` here, and the chunked kernels ran their dot products in bf16).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import composer_trl.trainer as trainer_module
import pytest
import torch
from composer_trl.loss import composer_trl_loss


def _hints(prompts: list[Any], completions: list[str], **_: Any) -> list[str]:
    return ["Reverse the digits. " for _ in prompts]


def _leaf_copy(batch: Any, dtype: torch.dtype | None) -> tuple[Any, list[torch.Tensor]]:
    leaves = []
    fields = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            v = v.detach().clone()
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
            if f.name in ("logprobs", "student_hidden", "lm_head_weight"):
                v.requires_grad_()
                leaves.append(v)
        fields[f.name] = v
    return type(batch)(**fields), leaves


@pytest.mark.parametrize("wrapper", ["none", "taid", "entropy_opd"])
def test_train_step_under_autocast_with_sdpo_full(
    wrapper, tmp_path, model_dir, tokenizer, dataset, h, monkeypatch
):
    extra: dict[str, Any] = {"sdpo_wrapper": wrapper}
    if wrapper == "entropy_opd":
        extra["entropy_opd_threshold"] = 0.0
    args = h.grpo_args(tmp_path, max_steps=1, beta_replay=0.0, bf16=True, sdpo_chunk_size=3, **extra)
    trainer = h.make_trainer(model_dir, tokenizer, dataset, args, hint_fn=_hints)
    monkeypatch.setattr(
        trainer, "compute_loss_context_manager", lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    )
    seen: list[dict[str, Any]] = []
    real = trainer_module.composer_trl_loss

    def spy(batch: Any, a: Any, counts: Any, **kw: Any) -> Any:
        assert torch.is_autocast_enabled("cpu")  # the ambient autocast reaches the loss
        assert batch.student_hidden is not None
        ambient, leaves_a = _leaf_copy(batch, None)
        loss_a, res_a = composer_trl_loss(ambient, a, counts, **kw)
        grads_a = torch.autograd.grad(loss_a, leaves_a, allow_unused=True)
        with torch.autocast("cpu", enabled=False):
            ref, leaves_r = _leaf_copy(batch, torch.float32)
            loss_r, res_r = composer_trl_loss(ref, a, counts, **kw)
            grads_r = torch.autograd.grad(loss_r, leaves_r, allow_unused=True)
        seen.append(
            {
                "hidden_dtype": batch.student_hidden.dtype,
                "loss": (loss_a.detach(), loss_r.detach()),
                "sdpo": (res_a.sdpo.detach(), res_r.sdpo.detach()),
                "grads": list(zip(grads_a, grads_r, leaves_a)),
            }
        )
        return real(batch, a, counts, **kw)

    monkeypatch.setattr(trainer_module, "composer_trl_loss", spy)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert seen, "the loss was never computed"
    row = next(r for r in trainer.state.log_history if "reward" in r)
    assert row["composer/loss/sdpo"] > 0 and row["composer/sdpo/skipped"] == 0
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    for s in seen:
        assert s["hidden_dtype"] == torch.float32
        a, r = s["sdpo"]
        assert a.dtype == torch.float32 and a.item() > 0
        torch.testing.assert_close(a, r, rtol=2e-6, atol=1e-12)
        torch.testing.assert_close(s["loss"][0].float(), s["loss"][1], rtol=2e-6, atol=1e-12)
        for g_a, g_r, leaf in s["grads"]:
            if g_r is None:
                continue
            assert g_a.dtype == leaf.dtype  # gradients come back in the inputs' dtypes
            if leaf.dtype == torch.float32:
                torch.testing.assert_close(g_a, g_r, rtol=2e-6, atol=1e-12)
            else:  # one rounding of the float32 gradient to the leaf's dtype (plus one where α rescales it)
                torch.testing.assert_close(g_a.float(), g_r.to(leaf.dtype).float(), rtol=2**-7, atol=1e-30)
