"""A plain swap is plain GRPO: TRL's own ``GRPOConfig`` handed to ``ComposerGRPOTrainer`` instead of ``GRPOTrainer``
trains bit for bit as ``GRPOTrainer`` does, for every TRL 1.16 loss type and option group.

Each case trains both trainers for 4 optimiser steps from the same saved model and seed (``num_iterations=2``,
so steps 2 and 4 reuse a generation batch and the importance ratio moves off 1) and checks, bitwise: every
logged value GRPOTrainer logs (loss, rewards, entropy, kl, clip ratios, ...), and every parameter at the end.

What cannot run here, and why:
- **real vLLM** (``use_vllm=True``): vLLM cannot be installed on these machines (no CUDA). The vLLM cases use
  :class:`StandInVLLM`, a stand-in for ``trl.generation.vllm_generation.VLLMGeneration`` (not vLLM): it samples
  completions from the model itself with a seeded generator and returns their log-probs with a deterministic
  perturbation standing in for the inference/training mismatch, so TRL's importance-sampling correction
  (``importance_sampling_ratio``, ``sampling_per_token_logps``) is non-trivial. Everything after generation is TRL's
  own code path, in both trainers.
- **``use_liger_kernel=True``**: in TRL 1.16 it only patches the model's layers with Liger's Triton kernels (TRL
  no longer uses Liger's GRPO loss: the loss is ``_compute_loss`` either way); Triton needs a GPU. Composer's loss
  reads the same log-probs from the same patched model, and the config is accepted (tested below).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

VLLM = {"use_vllm": True, "vllm_mode": "colocate"}
CASES: list[dict[str, Any]] = [
    {"loss_type": "grpo"},
    {"loss_type": "bnpo"},
    {"loss_type": "dr_grpo"},
    {"loss_type": "dapo"},
    {"loss_type": "cispo", "epsilon_high": 1.05},
    {"loss_type": "sapo", "sapo_temperature_neg": 2.0},
    {"loss_type": "vespo"},
    {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    {"loss_type": "grpo", "importance_sampling_level": "sequence"},  # GSPO
    {"loss_type": "dapo", "importance_sampling_level": "sequence", "beta": 0.04},
    {"loss_type": "dapo", "top_entropy_quantile": 0.5},
    {"loss_type": "dapo", "off_policy_mask_threshold": 0.0},
    {"loss_type": "grpo", "entropy_coef": 0.05},
    {"loss_type": "dapo", "use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 100.0},
    {
        "loss_type": "dapo",
        "top_entropy_quantile": 0.5,
        "entropy_coef": 0.05,
        "gradient_accumulation_steps": 2,
    },
    {"loss_type": "dapo", **VLLM, "vllm_importance_sampling_mode": "token_truncate"},
    {"loss_type": "grpo", **VLLM, "vllm_importance_sampling_mode": "sequence_mask"},
    {"loss_type": "dapo", "use_vllm": True, "vllm_mode": "server", "off_policy_mask_threshold": 0.01},
    {"loss_type": "vespo", **VLLM, "vllm_importance_sampling_mode": "token_mask"},
    {"loss_type": "dapo", **VLLM, "vllm_importance_sampling_correction": False},
]


class StandInVLLM:
    """A stand-in for ``VLLMGeneration`` (NOT vLLM): seeded sampling from the model, perturbed log-probs."""

    def __init__(self, *, model: Any, max_completion_length: int, temperature: float, **_: Any) -> None:
        self.model, self.max_new, self.temperature = model, max_completion_length, temperature
        self.generator = torch.Generator().manual_seed(0)
        config = SimpleNamespace(max_model_len=model.config.max_position_embeddings)
        self.llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=config))
        info = {"model_config": {"logprobs_mode": "processed_logprobs"}}
        self.vllm_client = SimpleNamespace(get_server_info=lambda: info)

    def sync_weights(self) -> None:  # the stand-in samples from the live model: nothing to push
        pass

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any = None
    ) -> tuple:
        completions, logprobs = [], []
        for prompt in prompts:
            ids, lps = list(prompt), []
            for _ in range(self.max_new):
                logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float() / self.temperature
                logp = torch.log_softmax(logits, -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
                noise = 0.05 * math.sin(7.0 * len(lps) + token)  # the inference engine's numerical mismatch
                ids.append(token)
                lps.append([float(logp[token]) + noise])
                if token == self.model.config.eos_token_id:
                    break
            completions.append(ids[len(prompt) :])
            logprobs.append(lps)
        return prompts, completions, logprobs, None


def _train(
    composer: bool, case: dict[str, Any], tmp_path: Any, model_dir: Any, tokenizer: Any, dataset: Any, h: Any
):
    from transformers import AutoModelForCausalLM

    opts = {"num_iterations": 2, "max_steps": 4, **case}
    args = h.grpo_args(
        tmp_path / ("composer" if composer else "trl"), composer=False, **opts
    )  # TRL's own config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = h.make_trainer(model, tokenizer, dataset, args, composer=composer)
    trainer.train()
    return trainer


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_plain_swap_trains_bitwise_like_grpo_trainer(
    case, monkeypatch, tmp_path, model_dir, tokenizer, dataset, h
):
    if case.get("use_vllm"):
        monkeypatch.setattr("trl.trainer.grpo_trainer.VLLMGeneration", StandInVLLM)
    plain = _train(False, case, tmp_path, model_dir, tokenizer, dataset, h)
    swap = _train(True, case, tmp_path, model_dir, tokenizer, dataset, h)
    assert swap.args.alpha_sdpo == swap.args.beta_replay == 0.0
    logged_p = [r for r in plain.state.log_history if "loss" in r]
    logged_s = [r for r in swap.state.log_history if "loss" in r]
    assert len(logged_p) == len(logged_s) == 4
    skip = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
    for rp, rs in zip(logged_p, logged_s):
        for key, value in rp.items():
            if key.endswith(skip) or key.startswith("profiling/"):
                continue
            assert key in rs, key
            same = rs[key] == value or (
                isinstance(value, float) and math.isnan(value) and math.isnan(rs[key])
            )
            assert same, (key, value, rs[key])
    for (name, a), (_, b) in zip(plain.model.named_parameters(), swap.model.named_parameters()):
        assert torch.equal(a, b), name
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(model_dir)
    assert any(
        not torch.equal(a, b) for a, b in zip(plain.model.parameters(), start.parameters())
    )  # it trained


def test_liger_kernel_config_is_accepted(tmp_path, h):
    from composer_trl import ComposerGRPOConfig

    args = h.grpo_args(tmp_path, composer=False, use_liger_kernel=True)
    assert ComposerGRPOConfig.from_grpo_config(args).use_liger_kernel is True


@pytest.mark.parametrize(
    "case",
    [
        {"loss_type": "vespo", **VLLM, "vllm_importance_sampling_mode": "token_truncate"},
        {"loss_type": "sapo", "importance_sampling_level": "sequence", "top_entropy_quantile": 0.5},
        {"loss_type": "cispo", "epsilon_high": 2.0, "off_policy_mask_threshold": 0.0, "entropy_coef": 0.05},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_channels_on_combine_with_the_grpo_options(
    case, monkeypatch, tmp_path, model_dir, tokenizer, dataset, h
):
    """The policy options act on channel 1; channels 2 and 3 train beside them (all three losses logged > 0)."""
    from composer_core.tasks.digit_reversal import reverse_hints

    if case.get("use_vllm"):
        monkeypatch.setattr("trl.trainer.grpo_trainer.VLLMGeneration", StandInVLLM)
    args = h.grpo_args(tmp_path, num_iterations=2, max_steps=2, dpo_variant="simpo", **case)
    trainer = h.make_trainer(model_dir, tokenizer, dataset, args, hint_fn=reverse_hints)
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss"]) and r["composer/loss/sdpo"] > 0 and r["composer/replay/pairs"] > 0


def test_positional_construction_equals_keyword_construction(tmp_path, model_dir, tokenizer, dataset, h):
    """``ComposerGRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class)`` binds as
    GRPOTrainer binds it (issue 60: it raised "got multiple values for argument 'model'"), with SDPO on (successful
    siblings teach): the first step's logged loss and the weights after it equal keyword construction's, bit for bit.
    """
    import inspect

    from composer_core.tasks.digit_reversal import reverse_reward
    from composer_trl import ComposerGRPOTrainer
    from trl import GRPOTrainer

    params = list(inspect.signature(ComposerGRPOTrainer).parameters)
    assert params == [*inspect.signature(GRPOTrainer).parameters, "hint_fn"]
    runs = []
    for positional in (True, False):
        args = h.grpo_args(
            tmp_path / str(positional), max_steps=1, beta_replay=0.0, sdpo_teacher_context="success"
        )
        if positional:
            t = ComposerGRPOTrainer(str(model_dir), [reverse_reward], args, dataset, None, tokenizer)
        else:
            t = ComposerGRPOTrainer(
                model=str(model_dir), reward_funcs=[reverse_reward], args=args, train_dataset=dataset,
                processing_class=tokenizer,
            )  # fmt: skip
        t.train()
        runs.append(t)
    logged = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in runs]
    assert len(logged[0]) == 1 and logged[0] == logged[1]
    for (n, a), (_, b) in zip(runs[0].model.named_parameters(), runs[1].model.named_parameters()):
        assert torch.equal(a, b), n
    with pytest.raises(TypeError, match="multiple values for argument 'model'"):
        ComposerGRPOTrainer(str(model_dir), model=str(model_dir))
