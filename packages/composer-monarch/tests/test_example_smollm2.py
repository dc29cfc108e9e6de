"""The SmolLM2-135M-Instruct recipe (``examples/smollm2-reverse-digits/train.py``) at a tiny size, on a real mesh.

What runs: the recipe script itself (``python train.py``, its ``main``) on a local Monarch proc mesh of 2 processes,
1 step, with ``--model`` = a directory holding composer-core's tiny Qwen2 and its ChatML character tokenizer
(saved with ``save_pretrained``, loaded back by the script through ``AutoModelForCausalLM`` /
``AutoTokenizer`` exactly as SmolLM2's directory would be): the chat-template prompts, the actors, all three
channels. What does not run: SmolLM2's own weights (the recipe's default ``--model``; no download here).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "smollm2-reverse-digits" / "train.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from composer_core.tasks import digit_reversal as dr
    from composer_core.tasks.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    path = tmp_path_factory.mktemp("tiny-chat-model")
    tok = build_char_tokenizer(dr.ALPHABET, chatml=True)
    build_tiny_model(tok, TinyModelConfig(hidden_size=32, intermediate_size=64), seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_task_over_the_tokenizer(model_dir: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("composer_monarch_example_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train  # dataclasses look their module up there
    spec.loader.exec_module(train)  # the recipe module (its classes, not its main)
    task = train.ChatReverseDigits(str(model_dir), length=3, instruction="")
    prompts = task.prompts(2, step=0)
    text = task.text(prompts[0])
    assert text.endswith(">") and len(text) == 4  # "381>" inside the chat template
    assert task.tokenizer.decode(prompts[0]).startswith("<|im_start|>user\n")
    right = task.target(prompts[0])
    assert task.reward(prompts[0], right) == 1.0
    wrong = task.target(prompts[1])  # another prompt's answer (may happen to be right)
    width = max(len(right), len(wrong))
    completions = torch.stack(
        [torch.cat([r, torch.full((width - len(r),), task.pad_id)]) for r in (right, wrong)]
    )
    hinted, has_hint = task.hinted_prompts(prompts, completions, completions != task.pad_id)
    assert hinted.shape[0] == 2 and not bool(has_hint[0])  # the right answer gets no hint


def test_recipe_runs_one_step_on_a_local_mesh(model_dir: Path) -> None:
    args = ["--model", str(model_dir), "--steps", "1", "--prompts-per-step", "2", "--group-size", "4"]
    args += ["--instruction", "", "--threads", "1", "--timeout", "180", "--lr", "1e-3"]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-6000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1, out.stdout[-4000:]
    row = rows[0]
    assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
    assert 0.0 <= row["reward_mean"] <= 1.0
    assert row["composer/sdpo/tokens"] > 0  # the untrained model is wrong: the feedback hints were distilled
    assert (
        row["pairs"] > 0 and row["composer/replay/skipped"] == 0.0
    )  # the replayed right answers were preferred
