"""Issue 50: what would hang a run or leave it half made is refused in one line.

- a prompt longer than the model's context (TRL 1.16 has no prompt truncation): ``composer-train`` refuses it
  before the model loads (exit 2, nothing written); ``ComposerGRPOTrainer`` raises ``ValueError`` at the batch
  holding it, before generation;
- a reward function that raises, or a generation batch no reward function scored (every completion NaN/None,
  TRL's "All reward functions returned None" for every row): exit 5, one line naming ``module:function`` and the
  dataset rows; the output directory the run created is removed unless complete checkpoints were saved.

The CLI runs as a subprocess (the real entry point, the tiny model, jsonl datasets); every wait is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from composer_core.tasks.digit_reversal import make_dataset_rows, reverse_reward

REWARDS = (
    "CALLS = [0]\n"
    "def boom(prompts, completions, **kw):\n"
    "    raise RuntimeError('reward server said no')\n"
    "def nan(prompts, completions, **kw):\n"
    "    return [float('nan')] * len(completions)\n"
    "def third_call_raises(prompts, completions, **kw):\n"
    "    CALLS[0] += 1\n"
    "    if CALLS[0] == 3:\n"
    "        raise ValueError('bad row')\n"
    "    return [0.5] * len(completions)\n"
)
SMALL = ["--per_device_train_batch_size", "8", "--num_generations", "4", "--no_plot"]
PLAIN = ["--alpha_sdpo", "0", "--beta_replay", "0"]  # no channel line on stderr
LONG = 100_000


def _data(path: Path, n: int, long_row: int | None = None) -> Path:
    rows = make_dataset_rows(n, seed=1)
    if long_row is not None:
        rows[long_row]["prompt"] = "1" * LONG
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cli(tmp_path: Path, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    (tmp_path / "faulty_reward_50.py").write_text(REWARDS)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "composer_trl.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _said(err: str) -> list[str]:
    """The stderr lines other than the progress bar's frames (``composer: 50%|...``)."""
    frames = (seg.split("\r")[-1] for seg in err.split("\n"))
    return [f for f in frames if f.strip() and not f.startswith("composer: ")]


@pytest.mark.timeout(300)
def test_overlong_prompt_is_refused_before_the_model_loads(tmp_path):
    data, out = _data(tmp_path / "train.jsonl", 4, long_row=1), tmp_path / "out"
    args = ["--dataset_name", str(data), "--output_dir", str(out), "--max_steps", "2", *SMALL, *PLAIN]
    res = _cli(tmp_path, args, timeout=120)  # before the fix: generation over 100k tokens, minutes or OOM
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr[-3000:]
    assert len(lines) == 1, res.stderr[-3000:]
    line = lines[0]
    assert line.startswith("composer-train: error: --dataset_name") and "row 1:" in line
    assert f"{LONG} tokens" in line and "max_completion_length=3" in line and "context is 64" in line
    assert "shorten" in line
    assert not out.exists()


@pytest.mark.timeout(120)
def test_trainer_refuses_overlong_prompt_at_its_batch(tmp_path, tokenizer, h):
    from composer_core.tasks.tiny import build_tiny_model
    from datasets import Dataset

    rows = make_dataset_rows(2, seed=1)
    rows[1]["prompt"] = "1" * LONG
    args = h.grpo_args(tmp_path, alpha_sdpo=0.0, beta_replay=0.0, max_steps=1)
    trainer = h.make_trainer(build_tiny_model(tokenizer, seed=0), tokenizer, Dataset.from_list(rows), args)
    with pytest.raises(ValueError, match=rf"train_dataset row 1: the prompt is {LONG} tokens.*context is 64"):
        trainer.train()


@pytest.mark.timeout(300)
def test_reward_that_raises_is_one_line_exit_5_and_nothing_kept(tmp_path):
    data, out = _data(tmp_path / "train.jsonl", 16), tmp_path / "out"
    args = ["--dataset_name", str(data), "--reward_funcs", "faulty_reward_50:boom", "--output_dir", str(out)]
    res = _cli(tmp_path, [*args, "--max_steps", "2", *SMALL, *PLAIN], timeout=240)
    shown = _said(res.stderr)
    assert res.returncode == 5, res.stderr[-3000:]
    assert len(shown) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    line = shown[0]
    assert line.startswith("composer-train: error: reward function faulty_reward_50:boom raised")
    assert "RuntimeError: reward server said no" in line and "dataset rows" in line and "step 1" in line
    assert not out.exists()


@pytest.mark.timeout(300)
def test_reward_nan_for_every_completion_keeps_only_the_users_files(tmp_path):
    data, out = _data(tmp_path / "train.jsonl", 16), tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["--dataset_name", str(data), "--reward_funcs", "faulty_reward_50:nan", "--output_dir", str(out)]
    res = _cli(tmp_path, [*args, "--max_steps", "2", "--overwrite_output_dir", *SMALL, *PLAIN], timeout=240)
    shown = _said(res.stderr)
    assert res.returncode == 5, res.stderr[-3000:]
    assert len(shown) == 1, res.stderr[-3000:]
    assert "faulty_reward_50:nan" in shown[0] and "no completion" in shown[0] and "dataset rows" in shown[0]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.timeout(300)
def test_reward_failure_after_checkpoints_keeps_them(tmp_path):
    data, out = _data(tmp_path / "train.jsonl", 16), tmp_path / "out"
    args = ["--dataset_name", str(data), "--reward_funcs", "faulty_reward_50:third_call_raises"]
    args += ["--output_dir", str(out), "--max_steps", "4", "--save_steps", "1", *SMALL, *PLAIN]
    res = _cli(tmp_path, args, timeout=240)
    shown = _said(res.stderr)
    assert res.returncode == 5, res.stderr[-3000:]
    assert len(shown) == 1 and "step 3" in shown[0] and "ValueError: bad row" in shown[0], res.stderr[-3000:]
    assert "checkpoint-2" in shown[0] and "kept" in shown[0] and "--resume_from_checkpoint last" in shown[0]
    assert (out / "trainer-composer" / "checkpoint-2" / "trainer_state.json").is_file()
    assert not (out / "summary.json").exists()


@pytest.mark.timeout(120)
def test_trainer_keeps_trl_semantics_for_partly_unscored_batches(tmp_path, model_dir, tokenizer, dataset, h):
    """None for some completions is TRL's (they get no advantage); a batch nobody scored raises, naming it."""
    from composer_trl import ComposerGRPOTrainer
    from composer_trl.guards import RewardFunctionError

    def half(prompts, completions, **kw):
        return [None if i % 2 else r for i, r in enumerate(reverse_reward(prompts, completions, **kw))]

    def nothing(prompts, completions, **kw):
        return [None] * len(completions)

    args = h.grpo_args(tmp_path, alpha_sdpo=0.0, beta_replay=0.0, max_steps=1)
    for funcs in ([half], [nothing, half]):
        t = ComposerGRPOTrainer(
            model=str(model_dir),
            reward_funcs=funcs,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        t.train()
        assert t.state.global_step == 1
    t = ComposerGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[nothing],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    with pytest.raises(
        RewardFunctionError, match=r"no completion.*test_run_faults:.*nothing.*dataset rows \d+"
    ):
        t.train()
