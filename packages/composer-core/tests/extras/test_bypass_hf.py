"""Bypass on real transformers Llama / Qwen2 / Mistral models (tiny, built from config)."""

from pathlib import Path

import pytest
import torch
import transformers
from composer_core.bypass import BlockOverride, BlockwiseModel, build_student, config_from_dict, run_bypass
from composer_core.bypass.checkpoint import load_checkpoint
from composer_core.bypass.data import synthetic_tokens
from composer_core.bypass.distributed import DistContext
from composer_core.bypass.forward import teacher_forward
from composer_core.bypass.hf import HFDecoder, load_hf_model
from composer_core.bypass.losses import normalized_mse

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 4}),
}
HETERO = [
    BlockOverride(intermediate_size=16, num_key_value_heads=2),
    BlockOverride(blocks=(1,), attention_no_op=True),
]


def export_student(student: BlockwiseModel, checkpoint: Path, out: Path) -> Path:
    """Load every block of ``checkpoint`` into ``student`` (built whole with the run's config) and ``save`` it."""
    load_checkpoint(
        checkpoint, model=student, blocks=range(student.num_blocks), optimizers=None, ctx=DistContext()
    )
    student.save(out)
    return out


def _teacher(arch: str, path: Path) -> HFDecoder:
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    cfg = cfg_cls(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        **extra,
    )
    model_cls(cfg).save_pretrained(path)
    return load_hf_model(path)


def _losses(teacher: HFDecoder, student: HFDecoder, ids: torch.Tensor) -> list[float]:
    t_in, t_out, ctx = teacher_forward(teacher, ids, range(teacher.num_blocks), DistContext())
    with torch.no_grad():
        return [normalized_mse(student.run_block(i, t_in[i], ctx), t_out[i]).item() for i in t_in]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_blockwise_forward_matches_model(arch: str, tmp_path: Path) -> None:
    teacher = _teacher(arch, tmp_path / "t")
    ids = synthetic_tokens(64, 2, 10)
    hidden, ctx = teacher.prepare(ids)
    for i in range(teacher.num_blocks):
        hidden = teacher.run_block(i, hidden, ctx)
    with torch.no_grad():
        torch.testing.assert_close(teacher.logits(hidden), teacher.model(ids).logits, rtol=1e-5, atol=1e-5)
    assert _losses(teacher, build_student(teacher, []), ids) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_train_save_and_reload_heterogeneous_student(arch: str, tmp_path: Path) -> None:
    teacher = _teacher(arch, tmp_path / "t")
    ids = synthetic_tokens(64, 28, 10, seed=3)
    cfg = config_from_dict(
        {
            "student": {
                "overrides": [
                    {"intermediate_size": 16, "num_key_value_heads": 2},
                    {"blocks": [1], "attention_no_op": True},
                ]
            },
            "training": {"steps": 15, "micro_batch_size": 4, "lr": 1e-3},
            "run": {"output_dir": str(tmp_path / "runs"), "val_every": 15, "val_sequences": 4},
        }
    )
    before = build_student(teacher, HETERO)
    result = run_bypass(teacher, ids, cfg, progress=False)
    held = ids[-4:]
    b, a = _losses(teacher, before, held), _losses(teacher, result.student, held)  # type: ignore[arg-type]
    assert all(x < y for x, y in zip(a, b, strict=True)), (b, a)
    out = export_student(result.student, result.experiment_dir / "final", tmp_path / "student")
    saved = transformers.AutoConfig.from_pretrained(out)
    assert [c["attention"]["no_op"] for c in saved.composer_block_configs] == [False, True, False]
    reloaded = load_hf_model(out)
    with torch.no_grad():
        want = result.student.model(held).logits  # type: ignore[attr-defined]
        torch.testing.assert_close(reloaded.model(held).logits, want, rtol=0, atol=0)
    assert reloaded.model.model.layers[0].mlp.up_proj.weight.shape == (16, 32)
    with pytest.raises(Exception, match=r"(?i)size|shape"):  # a heterogeneous student needs load_hf_model
        transformers.AutoModelForCausalLM.from_pretrained(out)


def test_uniform_student_loads_with_plain_from_pretrained(tmp_path: Path) -> None:
    teacher = _teacher("llama", tmp_path / "t")
    student = build_student(teacher, [BlockOverride(intermediate_size=16, num_key_value_heads=2)])
    student.save(tmp_path / "s")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "s")
    assert (plain.config.intermediate_size, plain.config.num_key_value_heads) == (16, 2)
    ids = synthetic_tokens(64, 2, 10)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, student.model(ids).logits, rtol=0, atol=0)  # type: ignore[attr-defined]


def test_unsupported_models_raise() -> None:
    with pytest.raises(ValueError, match="not a Llama-style causal LM"):
        HFDecoder(torch.nn.Linear(2, 2))
    teacher = HFDecoder(
        transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
            )
        )
    )
    with pytest.raises(ValueError, match="mixer='mamba' is not supported for HF"):
        build_student(teacher, [BlockOverride(mixer="mamba")])
