"""`composer-train`'s run lifecycle: bad datasets, valid JSON, output-dir rules, kill-and-resume, signals.

The subprocess tests run the real console entry (`python -m composer_trl.cli`) with a reward that sleeps
0.3 s per call, so a signal lands while training is under way; every wait is bounded.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from composer_trl.cli import main
from composer_trl.lifecycle import EXIT_DATA, EXIT_USAGE, dumps
from composer_trl.progress import MetricsJSONL, read_jsonl
from safetensors.torch import load_file

SLOW_REWARD = (
    "import time\n"
    "from composer_core.tasks.digit_reversal import reverse_reward\n"
    "def reward(prompts, completions, **kw):\n"
    "    time.sleep(0.3)\n"
    "    return reverse_reward(prompts, completions, **kw)\n"
)
SMALL = ["--per_device_train_batch_size", "8", "--num_generations", "4", "--no_plot"]


def _rows(path: Path, n: int) -> None:
    from composer_core.tasks.digit_reversal import make_dataset_rows

    path.write_text("".join(json.dumps(r) + "\n" for r in make_dataset_rows(n, seed=1)))


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "is empty (0 rows)"),
        ("\n\n", "is empty (0 rows)"),
        (None, "has 1 rows but one optimiser step needs 2 prompts"),
        ("{not json\n", "could not be read"),
        ('{"text": "1>"}\n{"text": "2>"}\n', "needs a `prompt` column"),
    ],
)
def test_bad_dataset_fails_before_training_with_one_line_and_exit_3(tmp_path, capsys, content, match):
    data = tmp_path / "train.jsonl"
    if content is None:
        _rows(data, 1)  # 8 completions / 4 generations = 2 prompts per step
    else:
        data.write_text(content)
    out = tmp_path / "out"
    rc = main(["--dataset_name", str(data), "--output_dir", str(out), "--max_steps", "2", *SMALL])
    err = capsys.readouterr().err.strip()
    assert rc == EXIT_DATA == 3
    assert len(err.splitlines()) == 1 and match in err and "--dataset_name" in err
    assert not out.exists()  # nothing saved


def test_missing_model_directory_says_so(tmp_path, capsys):
    out = tmp_path / "out"
    for name in (str(tmp_path / "no-such-model"), "./models/qwen-missing/"):
        rc = main(["--model_name_or_path", name, "--output_dir", str(out), "--max_steps", "1", "--no_plot"])
        err = capsys.readouterr().err.strip()
        assert rc == EXIT_USAGE and len(err.splitlines()) == 1
        assert "does not exist" in err and "Repo id" not in err
    assert not out.exists()


def test_summary_and_metrics_are_strict_json_with_nonfinite_flagged(tmp_path):
    text = dumps({"a": float("nan"), "b": {"c": float("inf")}, "d": 1.5})
    assert json.loads(text) == {"a": None, "b": {"c": None}, "d": 1.5, "nonfinite": ["a", "b.c"]}
    cb = MetricsJSONL(tmp_path / "m.jsonl")

    class S:
        global_step = 1

    cb.on_log(None, S(), None, logs={"reward": float("nan"), "loss": 0.5})
    line = (tmp_path / "m.jsonl").read_text().strip()
    assert "NaN" not in line
    assert json.loads(line) == {"step": 1, "reward": None, "loss": 0.5, "nonfinite": ["reward"]}
    # strict parsers refuse a bare NaN: what json.dumps wrote before
    with pytest.raises(ValueError):
        json.loads(json.dumps({"x": math.nan}), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


def test_rerun_into_non_empty_output_dir_refuses_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics-composer.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    (out / "notes.txt").write_text("mine")
    args = ["--output_dir", str(out), "--max_steps", "1", *SMALL]
    assert main(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "is not empty" in err and "--overwrite_output_dir" in err
    assert (out / "metrics-composer.jsonl").read_text() == '{"step": 1, "reward": 0.5}\n'  # untouched
    assert main([*args, "--overwrite_output_dir"]) == 0
    assert [r["step"] for r in read_jsonl(out / "metrics-composer.jsonl")] == [1]
    assert (out / "notes.txt").read_text() == "mine"  # only composer-train's own outputs are replaced
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "slow_reward_lc.py").write_text(SLOW_REWARD)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _wait_for(pred, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"the run ended (rc {proc.returncode}) before {what}:\n{out[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "composer_trl.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _logged_steps(path: Path) -> list[int]:
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


EMA_TEACHER = [
    "--sdpo_teacher",
    "ema",
    "--sdpo_teacher_context",
    "success",
    "--success_reward_threshold",
    "0.3",
]
EMA_TEACHER += ["--teacher_update_rate", "0.3"]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("options", [["--sdpo_wrapper", "taid"], EMA_TEACHER], ids=["taid", "ema-teacher"])
def test_sigkill_then_resume_last_is_bit_exact(options, tmp_path, monkeypatch):
    """Uninterrupted 6 steps == (killed after step 3, resumed from checkpoint-2): torch.equal on every weight,
    identical logged rewards/losses and TAID t; each step logged once (the killed run's step 3 is dropped).
    With the EMA SDPO teacher its weights (saved in each checkpoint) are equal too."""
    env = _env(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ["--max_steps", "6", "--save_steps", "2", "--reward_funcs", "slow_reward_lc:reward"]
    common += [*options, *SMALL]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert main([*common, "--output_dir", str(ref)]) == 0

    proc = _spawn([*common, "--output_dir", str(cut)], env)
    ckpt2 = cut / "trainer-composer" / "checkpoint-2" / "composer_state.json"
    _wait_for(lambda: ckpt2.is_file() and 3 in _logged_steps(cut / "metrics-composer.jsonl"), proc, "step 3")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert not (cut / "trainer-composer" / "checkpoint-6").exists() and not (cut / "summary.json").exists()

    assert main([*common, "--output_dir", str(cut), "--resume_from_checkpoint", "last"]) == 0
    a, b = load_file(ref / "model" / "model.safetensors"), load_file(cut / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = read_jsonl(ref / "metrics-composer.jsonl"), read_jsonl(cut / "metrics-composer.jsonl")
    assert [r["step"] for r in rb] == [1, 2, 3, 4, 5, 6]
    keys = ["reward", "composer/loss/policy", "composer/loss/sdpo", "composer/loss/replay"]
    keys += ["composer/taid/t"] if "taid" in options else []
    assert [[r[k] for k in keys] for r in ra] == [[r[k] for k in keys] for r in rb]
    if "taid" in options:
        assert len({r["composer/taid/t"] for r in rb}) > 1  # TAID's t moved, so restoring it mattered
        return
    teacher = Path("trainer-composer", "checkpoint-6", "composer_sdpo_teacher.safetensors")
    ta, tb, t0 = (
        load_file(ref / teacher),
        load_file(cut / teacher),
        load_file(ref / teacher.parent.parent / "checkpoint-2" / teacher.name),
    )
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert any(not torch.equal(ta[k], t0[k]) for k in ta)  # the EMA moved between the checkpoints
    assert sum(r["composer/loss/sdpo"] > 0 for r in rb) >= 3  # the teacher was used


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_finishes_step_writes_checkpoint_and_summary(tmp_path, sig, code):
    env = _env(tmp_path)
    out = tmp_path / "out"
    proc = _spawn(
        ["--max_steps", "200", "--reward_funcs", "slow_reward_lc:reward", "--output_dir", str(out), *SMALL],
        env,
    )
    _wait_for(lambda: 1 in _logged_steps(out / "metrics-composer.jsonl"), proc, "step 1")
    proc.send_signal(sig)
    try:
        stdout, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{sig.name}: the run did not stop within 300 s")
    assert proc.returncode == code, stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    step = summary["composer"]["global_step"]
    assert summary["status"] == "interrupted" and summary["composer"]["signal"] == sig.name
    assert 1 <= step < 200
    ckpt = out / "trainer-composer" / f"checkpoint-{step}"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "composer_state.json").is_file()
    assert _logged_steps(out / "metrics-composer.jsonl") == list(range(1, step + 1))
    assert f"stopped by {sig.name}" in stdout


def _fake_checkpoint(folder: Path, step: int, skip: tuple[str, ...] = ()) -> Path:
    ckpt = folder / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    from safetensors.torch import save_file

    files = {
        "trainer_state.json": lambda p: p.write_text(json.dumps({"global_step": step})),
        "optimizer.pt": lambda p: torch.save({"state": {}}, p),  # every file reads back (issue 62)
        "model.safetensors": lambda p: save_file({"w": torch.zeros(2)}, str(p)),
        "composer_state.json": lambda p: p.write_text("{}"),
    }
    for name, write in files.items():
        if name not in skip:
            write(ckpt / name)
    return ckpt


def test_last_skips_incomplete_newer_checkpoints_and_names_them(tmp_path, capsys):
    from composer_trl.lifecycle import UsageError, resolve_checkpoint

    good = _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4, skip=("trainer_state.json",))  # killed while transformers wrote it in place
    _fake_checkpoint(tmp_path, 6, skip=("optimizer.pt", "composer_state.json"))
    assert resolve_checkpoint("last", tmp_path) == good
    line = capsys.readouterr().out.strip()
    assert line.count("\n") == 0 and "resuming from checkpoint-2" in line
    assert (
        "checkpoint-6 (no optimizer.pt, composer_state.json)" in line
        and "checkpoint-4 (no trainer_state.json)" in line
    )
    with pytest.raises(UsageError, match=r"is incomplete .*pass `last`"):
        resolve_checkpoint(str(tmp_path / "checkpoint-6"), tmp_path)
    lone = _fake_checkpoint(tmp_path / "x", 1, skip=("optimizer.pt",)).parent
    with pytest.raises(UsageError, match="no complete checkpoint"):
        resolve_checkpoint("last", lone)
    # an ema/base SDPO teacher's weights are part of a complete checkpoint
    with pytest.raises(UsageError, match=r"composer_sdpo_teacher\.safetensors"):
        resolve_checkpoint("last", tmp_path, ("composer_sdpo_teacher.safetensors",))


def test_resume_last_after_a_kill_mid_save_trains_on_from_the_complete_one(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--max_steps", "4", "--save_steps", "2", *SMALL, "--output_dir", str(out)]
    assert main(common) == 0
    newest = out / "trainer-composer" / "checkpoint-4"
    (newest / "trainer_state.json").unlink()  # as a kill while transformers wrote checkpoint-4 leaves it
    for name in ("summary.json",):
        (out / name).unlink()
    capsys.readouterr()
    assert main([*common, "--resume_from_checkpoint", "last"]) == 0
    printed = capsys.readouterr().out
    assert "resuming from checkpoint-2; set aside incomplete checkpoint-4 (no trainer_state.json)" in printed
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"
