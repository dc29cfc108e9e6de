"""The serverless DiLoCo recipe (``examples/smollm2-serverless/train.py``) at a tiny size.

What runs: the recipe script itself (``python train.py``, its ``main``) with 2 replica processes
(``LocalProcessExecutor`` through ``run_serverless``), 1 outer round of 2 inner steps, over a ``file://`` store in a
temporary directory, with ``--model`` = a directory holding composer-core's tiny Qwen2 and its ChatML character
tokenizer (saved with ``save_pretrained``, loaded back by every replica through ``AutoModelForCausalLM`` /
``AutoTokenizer`` exactly as SmolLM2's directory would be): the chat-templated addition rows, torchft's DiLoCo on an
``ObjectStoreManager``, the per-round weight digests. What does not run: SmolLM2's own weights (the recipe's
default ``--model``; no download here) and ``s3://`` (the store itself is tested over moto elsewhere).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "smollm2-serverless" / "train.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from composer_core.tasks import addition
    from composer_core.tasks.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    text = addition.PROMPT + "0123456789 +="  # every character of the prompts and the answers
    alphabet = "".join(dict.fromkeys(text))
    path = tmp_path_factory.mktemp("tiny-chat-model")
    tok = build_char_tokenizer(alphabet, chatml=True)
    config = TinyModelConfig(hidden_size=32, intermediate_size=64, max_position_embeddings=128)
    build_tiny_model(tok, config, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_recipe_runs_one_round_with_two_replicas_over_a_file_store(model_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    args = ["--store", store.as_uri(), "--model", str(model_dir), "--replicas", "2", "--rounds", "1"]
    args += ["--sync-every", "2", "--batch-size", "4", "--train-rows", "16", "--held-out-rows", "4"]
    args += ["--lr", "1e-3", "--threads", "1", "--timeout", "60", "--workdir", str(tmp_path / "logs")]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-6000:] + out.stdout[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2, out.stdout[-4000:]  # one row per round, then the summary
    round_row, summary = rows
    assert round_row["round"] == 1 and round_row["identical"]
    assert len(round_row["digests"]) == 2 and len(set(round_row["digests"])) == 1
    assert all(math.isfinite(x) for x in round_row["mean_inner_loss"])
    assert summary["identical_every_round"] and summary["replicas"] == 2
    assert math.isfinite(summary["held_out_loss_before"])
    after = summary["held_out_loss_after"]
    assert len(after) == 2 and after[0] == after[1]  # same weights, same held-out loss
    assert "identical weights" in out.stdout
    assert not any(store.rglob("*.bin"))  # run_serverless cleaned the run's objects up
