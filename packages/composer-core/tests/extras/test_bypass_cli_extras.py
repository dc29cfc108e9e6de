"""composer-bypass with a YAML run file, an HF teacher and the PNG plot."""

from pathlib import Path

import pytest
import torch
import transformers
from composer_core.bypass.cli import main
from composer_core.bypass.hf import load_hf_model
from composer_core.bypass.report import plot_block_losses
from safetensors.torch import save_file

RUN = """
teacher: {{kind: hf, path: "{teacher}"}}
data: {{path: "{tokens}"}}
student:
  overrides:
    - {{intermediate_size: 16, num_key_value_heads: 1}}
training: {{steps: 4, micro_batch_size: 4, keys_to_learn: [subblock_ffn, subblock_attention]}}
run: {{output_dir: "{out}", val_every: 2, val_sequences: 4}}
"""


def test_yaml_hf_run_with_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "teacher")
    save_file({"input_ids": torch.randint(0, 64, (20, 8))}, str(tmp_path / "tokens.safetensors"))
    run = tmp_path / "run.yaml"
    run.write_text(
        RUN.format(teacher=tmp_path / "teacher", tokens=tmp_path / "tokens.safetensors", out=tmp_path / "o")
    )
    assert main(["--config", str(run), "--no-progress"]) == 0
    out = capsys.readouterr().out
    exp = next((tmp_path / "o").iterdir())
    png = exp / "block_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in out
    student = load_hf_model(exp / "student")
    assert student.model.config.num_key_value_heads == 1 and student.model.config.intermediate_size == 16


def test_plot_rejects_empty_history(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no history"):
        plot_block_losses([], tmp_path / "x.png")
