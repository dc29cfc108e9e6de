"""The composer-bypass CLI in-process (TOML; the YAML and plot paths are in tests/extras)."""

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from composer_core.bypass.cli import main, read_config_file
from composer_core.bypass.reference import ReferenceDecoder

RUN = """
[teacher]
kind = "reference"
path = "{teacher}"

[data]
path = "{tokens}"

[student]
overrides = [{{intermediate_size = 8}}]

[training]
steps = 3
micro_batch_size = 4

[run]
output_dir = "{out}"
val_every = 3
val_sequences = 4

[output]
plot = false

[[sweep]]
overrides = [{{intermediate_size = 8}}]

[[sweep]]
overrides = [{{intermediate_size = 16}}, {{blocks = [1], attention_no_op = true}}]
"""


def test_cli_sweep_table_export_and_resume(
    S: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    S.teacher().save(tmp_path / "teacher")
    S.write_tokens(tmp_path / "tokens.safetensors", S.tokens())
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        RUN.format(teacher=tmp_path / "teacher", tokens=tmp_path / "tokens.safetensors", out=tmp_path / "out")
    )
    assert main(["--config", str(cfg), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.count("assembled student LM loss") == 2 and "first step" in out and "(trained)" in out
    runs = sorted((tmp_path / "out").iterdir())
    assert len(runs) == 2
    for run in runs:
        assert (run / "history.json").is_file()
        ReferenceDecoder.load(run / "student")
    widths = {ReferenceDecoder.load(r / "student").layers[0].mlp.up_proj.weight.shape[0] for r in runs}
    assert widths == {8, 16}
    assert main(["--config", str(cfg), "--no-progress"]) == 0  # resume by default: both complete -> skipped
    assert capsys.readouterr().out.count("skipped: already complete") == 2


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[training]\nstepz = 3\n[teacher]\nkind = "reference"\npath = "x"\n')
    assert main(["--config", str(bad)]) == 2
    assert "unknown keys ['stepz']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown tables"):
        bad.write_text("[trainer]\n")
        read_config_file(bad)
    with pytest.raises(ValueError, match=r"use a \.toml"):
        read_config_file(tmp_path / "x.json") if (tmp_path / "x.json").write_text("{}") else None


@pytest.mark.skipif(importlib.util.find_spec("yaml") is not None, reason="checks the missing-extra message")
def test_yaml_without_extra_names_it(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text("training: {}\n")
    with pytest.raises(ImportError, match=r"composer-core\[yaml\]"):
        read_config_file(tmp_path / "run.yaml")
