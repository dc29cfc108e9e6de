"""ComposerGRPOTrainer on a CUDA device (skipped without one; CI has none, so ``scripts/cuda_checks.sh``
runs this module on a GPU machine).

Every tensor the trainer creates for the three channels (hinted prompts, pair tables, reference
log-probs, metric windows) must land on the accelerator's device, under bf16 mixed precision as
users train, for a dense and a mixture-of-experts model; and the loss and its gradient on the GPU
must be the CPU's for the same batch.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from composer_core import ADAPTER_PREFIX, GRAD_NORM_KEYS, METRIC_KEYS
from composer_core.tasks.digit_reversal import reverse_hints

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LOGGED_3_CHANNELS = {  # the grad_norm/* keys are opt-in (log_channel_grad_norms=False by default)
    ADAPTER_PREFIX + k
    for k in METRIC_KEYS
    if k not in GRAD_NORM_KEYS and not k.startswith(("policy/", "taid/"))
}


@pytest.mark.parametrize(
    ("kind", "sdpo"),
    [("dense", "full"), ("dense", "sampled"), ("moe", "full"), ("moe", "sampled"), ("dense", "compiled")],
)
def test_all_three_channels_train_on_the_gpu_under_bf16(
    kind, sdpo, tmp_path, model_dir, moe_dir, tokenizer, dataset, h
):
    """``compiled``: the full form's JSD chunk kernel under ``torch.compile`` (``sdpo_compiled``), inside TRL's
    bf16 autocast on the GPU."""
    sdpo_form = "sampled" if sdpo == "sampled" else "full"
    args = h.grpo_args(
        tmp_path,
        max_steps=2,
        dpo_variant="dpo",
        use_cpu=False,
        bf16=True,
        sdpo_form=sdpo_form,
        sdpo_compiled=sdpo == "compiled",
        beta=0.04,
    )
    trainer = h.make_trainer(
        model_dir if kind == "dense" else moe_dir, tokenizer, dataset, args, hint_fn=reverse_hints
    )
    assert trainer.accelerator.device.type == "cuda"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert {p.device.type for p in after.values()} == {"cuda"}
    assert any(not torch.equal(before[n], after[n]) for n in before)
    logs = [row for row in trainer.state.log_history if "reward" in row]
    assert len(logs) == 2
    for row in logs:
        assert {k for k in row if k.startswith("composer/")} == LOGGED_3_CHANNELS
        assert all(math.isfinite(row[k]) for k in LOGGED_3_CHANNELS)
        # the full divergence is positive; its sampled-token estimate has either sign
        assert row["composer/loss/sdpo"] > 0 if sdpo_form == "full" else row["composer/loss/sdpo"] != 0
        assert row["composer/loss/replay"] > 0
        assert row["composer/sdpo/skipped"] == 0 and row["composer/replay/skipped"] == 0
        assert "kl" in row and math.isfinite(row["kl"])  # TRL's reference model, on the GPU too


def _to(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


@pytest.mark.parametrize("variant", ["dpo", "simpo"])
def test_the_loss_and_its_gradient_on_the_gpu_are_the_cpu_ones(
    variant, tmp_path, model_dir, tokenizer, dataset, h
):
    """One batch (generated on CPU, with non-zero advantages and stale old log-probs so every channel
    contributes), the loss, its metrics and every parameter's gradient, in float32 on each device (``bf16``
    off: TRL's default turns it on). On CPU float32 agrees with float64 to about 1e-6 of each gradient's norm,
    so 1e-4 leaves room for the GPU's other summation orders and nothing for a wrong operand."""
    got: dict[str, tuple[float, dict[str, float], dict[str, torch.Tensor]]] = {}
    inputs: Any = None
    for device in ("cpu", "cuda"):
        args = h.grpo_args(
            tmp_path / device,
            use_cpu=device == "cpu",
            num_iterations=2,
            dpo_variant=variant,
            beta=0.04,
            bf16=False,
        )
        trainer = h.make_trainer(model_dir, tokenizer, dataset, args, hint_fn=reverse_hints)
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        if inputs is None:
            torch.manual_seed(0)
            inputs = trainer._generate_and_score_completions(h.generation_batch(dataset, 2, 4))
            inputs["advantages"] = torch.linspace(-1.0, 1.0, 8)
            inputs["old_per_token_logps"] = inputs["old_per_token_logps"] - 0.1
        loss = trainer.compute_loss(trainer.model, _to(inputs, device))
        assert loss.device.type == device
        loss.backward()
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("composer/")}
        grads = {n: p.grad.detach().cpu() for n, p in trainer.model.named_parameters() if p.grad is not None}
        got[device] = (loss.item(), metrics, grads)
    (l_cpu, m_cpu, g_cpu), (l_gpu, m_gpu, g_gpu) = got["cpu"], got["cuda"]
    assert (
        m_cpu["composer/loss/policy"] != 0
        and m_cpu["composer/loss/sdpo"] > 0
        and m_cpu["composer/loss/replay"] > 0
    )
    assert l_gpu == pytest.approx(l_cpu, rel=1e-4, abs=1e-6)
    assert m_gpu.keys() == m_cpu.keys()
    for k in m_cpu:
        assert m_gpu[k] == pytest.approx(m_cpu[k], rel=1e-4, abs=1e-6), k
    assert g_gpu.keys() == g_cpu.keys() and len(g_cpu) > 0
    scale = max(float(g.norm()) for g in g_cpu.values())
    for n in g_cpu:  # relative to the tensor's norm, floored for gradients that are 0 in exact arithmetic
        err = float((g_gpu[n] - g_cpu[n]).norm())
        assert err <= 1e-4 * float(g_cpu[n].norm()) + 1e-7 * scale, (n, err, float(g_cpu[n].norm()))


def test_composer_train_runs_on_the_gpu_when_there_is_one(tmp_path):
    """The main job picks the GPU by itself (no flag) and writes its metrics, summary and model."""
    from composer_trl.cli import main
    from composer_trl.progress import read_jsonl

    torch.cuda.reset_peak_memory_stats()
    out = tmp_path / "run"
    assert main(["--steps", "3", "--output-dir", str(out), "--no-plot"]) == 0
    assert torch.cuda.max_memory_allocated() > 0  # the trainer ran on the card
    rows = read_jsonl(out / "metrics-composer.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("reward", "composer/loss/policy", "composer/loss/sdpo"))
        assert r["composer/loss/replay"] > 0
    assert (out / "model" / "config.json").is_file()
