"""`composer-train --compare --quick`: every run x seed, held-out eval, comparison.json/.md/.png, README block."""

from __future__ import annotations

import json

import pytest
from composer_trl.cli import main
from composer_trl.compare import RUNS, eval_steps, split_rows, update_readme
from composer_trl.progress import read_jsonl


def test_held_out_prompts_are_never_trained_on():
    for seed in range(3):
        train, held = split_rows(seed, 2400, 64)
        assert len(held) == 64 and len(train) == 2400
        assert not {r["prompt"] for r in train} & set(held)
    assert eval_steps(300) == {75, 150, 225, 300} and eval_steps(4) == {1, 2, 3, 4}


@pytest.mark.timeout(1500)
def test_compare_quick_writes_json_table_plot_and_fills_readme(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["--compare", "--quick", "--seeds", "2", "--output_dir", str(out)]) == 0
    report = json.loads((out / "comparison.json").read_text())
    assert list(report["runs"]) == [r.name for r in RUNS]
    assert report["runs"]["grpo"]["sees_oracle_answers"] == "no"
    assert all(r["sees_oracle_answers"].startswith("yes") for k, r in report["runs"].items() if k != "grpo")
    for run in report["runs"].values():
        assert [s["seed"] for s in run["seeds"]] == [0, 1]
        for s in run["seeds"]:
            assert [e["step"] for e in s["held_out"]] == [0, 1, 2, 3, 4]  # step 0 and every eval point
            assert all(0 <= e["exact_match"] <= e["partial_credit"] <= 1 for e in s["held_out"])
            assert [st for st, _ in s["train_reward"]] == [1, 2, 3, 4]
        assert run["final_partial_credit"]["n"] == 2
    # same seed, same first generation: every run starts from the same weights and prompts
    firsts = {run["seeds"][0]["train_reward"][0][1] for run in report["runs"].values()}
    assert len(firsts) == 1
    sft = read_jsonl(out / "seed-0" / "metrics-grpo-sft.jsonl")
    assert all(r["sft/nll"] > 0 for r in sft)  # the information-matched baseline trains on the answers
    assert all("sft/nll" not in r for r in read_jsonl(out / "seed-0" / "metrics-grpo.jsonl"))
    md = (out / "comparison.md").read_text()
    assert "mean ± std over 2 seeds" in md and md.count("\n| ") == 6
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- comparison:begin -->\nold 0.24\n<!-- comparison:end -->\nrest\n")
    update_readme(readme, out / "comparison.json")
    text = readme.read_text()
    assert "old 0.24" not in text and md in text and text.endswith("rest\n")
    c = report["runs"]["composer"]["final_partial_credit"]
    assert f"{c['mean']:.3f} ± {c['std']:.3f}" in text
