"""`composer-train`: the main job, its recipe files, and its outputs."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from composer_core.tasks.digit_reversal import feedback_hint, oracle_solve, verify, wrong_solution
from composer_trl.cli import main, parse
from composer_trl.lifecycle import UsageError
from composer_trl.progress import read_jsonl


def test_main_job_runs_composer_core_task_and_tiny_model():
    """The main job's rules live in composer-core (composer_core.tasks.digit_reversal / .tiny)."""
    import torch
    from composer_core.tasks.tiny import build_tiny_model
    from composer_trl.models import load_model
    from composer_trl.recipe import Recipe

    model, tok = load_model(Recipe(seed=3))
    ref = build_tiny_model(tok, seed=3).state_dict()
    assert model.state_dict().keys() == ref.keys()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    assert verify("381>", "133") == pytest.approx(2 / 3)
    assert feedback_hint("381>", "133") == ".8.|"
    assert oracle_solve("3817>") == "7183"
    assert verify("121>", wrong_solution("121>")) < 1.0


def test_composer_train_writes_metrics_plot_summary_and_model(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--steps", "4", "--output-dir", str(out)]) == 0  # the pre-TRL-parser flags still work
    printed = capsys.readouterr().out
    for name in ("metrics-composer.jsonl", "metrics.png", "summary.json"):
        assert (out / name).is_file()
        assert str((out / name).resolve()) in printed
    assert (out / "model" / "config.json").is_file()
    rows = read_jsonl(out / "metrics-composer.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"reward", "composer/loss/policy", "composer/loss/sdpo", "composer/loss/replay"} <= set(r)
        assert r["composer/loss/replay"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["status"] == "finished" and "composer" in summary
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_composer_train_model_dir_and_toml_recipe(tmp_path, model_dir):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        f'model = "{model_dir}"\nsteps = 2\noutput_dir = "{tmp_path / "out"}"\n'
        "[trainer]\nmax_completion_length = 3\nper_device_train_batch_size = 8\nnum_generations = 4\n"
        'learning_rate = 1e-3\nhint_template = "{hint}{prompt}"\n'
    )
    assert main(["--config", str(recipe), "--no-plot"]) == 0
    rows = read_jsonl(tmp_path / "out" / "metrics-composer.jsonl")
    assert len(rows) == 2 and all(r["composer/loss/sdpo"] >= 0 for r in rows)


def test_yaml_recipe_and_unknown_keys(tmp_path):
    y = tmp_path / "r.yaml"
    y.write_text("steps: 7\ntrainer:\n  alpha_sdpo: 0.5\n")
    r = parse(["--config", str(y)]).recipe
    assert r.steps == 7 and r.trainer_kwargs()["alpha_sdpo"] == 0.5
    y.write_text("stpes: 3\n")
    with pytest.raises(UsageError, match="unknown field 'stpes'"):
        parse(["--config", str(y)])
    (tmp_path / "r.txt").write_text("x")
    with pytest.raises(UsageError, match="unknown recipe format"):
        parse(["--config", str(tmp_path / "r.txt")])


def test_console_script_is_installed():
    exe = shutil.which("composer-train")
    assert exe is not None
    res = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--model" in res.stdout and "--compare" not in res.stdout


def test_recipe_dataset_reward_and_hint_fn_are_used(tmp_path, model_dir, monkeypatch, capsys):
    """The recipe's `dataset`, `reward` and `hint_fn` replace the embedded task's (README: real work)."""
    from composer_core.tasks.digit_reversal import make_dataset_rows

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_dataset_rows(64, seed=3)))
    (tmp_path / "recipe_fns_for_test.py").write_text(
        "HINT_CALLS = []\n"
        "def reward(prompts, completions, **kw):\n"
        "    return [0.25] * len(completions)\n"
        "def hint(prompts, completions, **kw):\n"
        "    HINT_CALLS.append(len(prompts))\n"
        "    return ['9' + c + '|' for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        f'model = "{model_dir}"\ndataset = "{data}"\nreward = "recipe_fns_for_test:reward"\n'
        f'hint_fn = "recipe_fns_for_test:hint"\nsteps = 2\noutput_dir = "{out}"\n'
        "[trainer]\nmax_completion_length = 3\nper_device_train_batch_size = 8\nnum_generations = 4\n"
    )
    assert main(["--config", str(recipe), "--no-plot"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("composer-train: alpha")]
    assert said == [  # the channels the recipe left unset, chosen from the data, in one line
        "composer-train: alpha_sdpo=1.0 (the data's hints teach), beta_replay=1.0 (chosen/rejected columns); "
        "set --alpha_sdpo / --beta_replay to choose."
    ]
    import recipe_fns_for_test

    rows = read_jsonl(out / "metrics-composer.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert r["reward"] == 0.25  # the recipe's reward, not the embedded verifier's partial credit
        # hints from the recipe's hint_fn; chosen/rejected of the dataset
        assert r["composer/sdpo/tokens"] > 0 and r["composer/loss/sdpo"] > 0
        assert r["composer/replay/pairs"] > 0 and r["composer/loss/replay"] > 0
    assert recipe_fns_for_test.HINT_CALLS


def test_recipe_dataset_errors_name_the_key(tmp_path, model_dir, capsys):
    bad = tmp_path / "no_prompt.jsonl"
    bad.write_text('{"text": "1>"}\n')
    for dataset, match in (
        (tmp_path / "missing.jsonl", "must be an existing"),
        (bad, "needs a `prompt` column"),
    ):
        recipe = tmp_path / "r.toml"
        recipe.write_text(
            f'model = "{model_dir}"\ndataset = "{dataset}"\nsteps = 1\noutput_dir = "{tmp_path / "o"}"\n'
        )
        assert main(["--config", str(recipe), "--no-plot"]) == 3
        assert match in capsys.readouterr().err
