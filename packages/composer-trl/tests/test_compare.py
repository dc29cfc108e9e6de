"""`bench/compare_tiny.py --quick` (what `nox -s demo -- --compare` runs): every run x seed, held-out eval,
comparison.json/.md/.png, finished cells kept, the README block; `composer-train --compare` names the new command."""

from __future__ import annotations

import json

import pytest
from composer_trl.cli import main
from composer_trl.progress import read_jsonl


def test_composer_train_compare_exits_2_naming_the_bench_command(tmp_path, capsys):
    assert main(["--compare", "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nox -s demo -- --compare" in err[0] and "bench/compare_smollm2.py" in err[0]
    assert not (tmp_path / "o").exists()


def test_held_out_prompts_are_never_trained_on(bench):
    split_rows, eval_steps = bench.compare_tiny.split_rows, bench.compare_tiny.eval_steps
    for seed in range(3):
        train, held = split_rows(seed, 2400, 64)
        assert len(held) == 64 and len(train) == 2400
        assert not {r["prompt"] for r in train} & set(held)
    assert eval_steps(300) == {75, 150, 225, 300} and eval_steps(4) == {1, 2, 3, 4}


@pytest.mark.timeout(1500)
def test_compare_quick_writes_json_table_plot_and_fills_readme(tmp_path, capsys, bench):
    RUNS, update_readme = bench.compare_tiny.RUNS, bench.compare_tiny.update_readme
    out = tmp_path / "cmp"
    argv = ["--quick", "--seeds", "2", "--output_dir", str(out)]
    assert bench.compare_tiny.main(argv) == 0
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
    capsys.readouterr()
    assert bench.compare_tiny.main(argv) == 0  # a rerun keeps every finished cell and rebuilds the same table
    assert capsys.readouterr().out.count("finished earlier, kept") == 2 * len(RUNS)
    assert (out / "comparison.md").read_text() == md


def test_grpo_plus_sft_adds_exactly_the_answer_nll(tmp_path, bench):
    """Constant reward (zero advantages, beta=0): GRPO's loss is 0, so the logged loss is the SFT term alone,
    equal to the mean token NLL of `chosen`+EOS after the prompt under the (lr=0, unchanged) initial model."""
    import torch
    import torch.nn.functional as F
    from composer_core.tasks.digit_reversal import ALPHABET
    from composer_core.tasks.tiny import build_char_tokenizer, build_tiny_model
    from datasets import Dataset
    from trl import GRPOConfig

    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model(tok, seed=0)
    row = {"prompt": "381>", "chosen": "183"}
    p = tok(row["prompt"], add_special_tokens=False)["input_ids"]
    c = [*tok(row["chosen"], add_special_tokens=False)["input_ids"], tok.eos_token_id]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([p + c])).logits[0, :-1].double()
    nll = F.cross_entropy(logits, torch.tensor((p + c)[1:]), reduction="none")[len(p) - 1 :]
    expected = float(nll.mean())
    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        learning_rate=0.0,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=3,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        beta=0.0,
        bf16=False,  # exact float32 math: transformers 5.23 turns bf16 autocast on by default where supported
    )
    logs = []

    class Keep(__import__("transformers").TrainerCallback):
        def on_log(self, args, state, control, logs_=None, **kw):
            logs.append(kw.get("logs") or logs_)

    trainer = bench._compare.GRPOPlusSFTTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.25] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([row] * 16),
        processing_class=tok,
        callbacks=[Keep()],
    )
    trainer.train()
    step = next(entry for entry in logs if entry and "sft/nll" in entry)
    assert step["sft/nll"] == pytest.approx(expected, rel=1e-5)
    assert step["loss"] == pytest.approx(expected, rel=1e-4)


def _cell(arm: str, seed: int, held: float, val: float) -> dict:
    scores = lambda em: {"exact_match": em, "partial_credit": em, "truncated": 0.0, "per_prompt": [em]}  # noqa: E731
    return {"arm": arm, "seed": seed, "held_out": scores(held), "validation": scores(val), "seconds_per_step": 1.0,
            "eval_seconds": 1.0, "peak_rss_mib": 100.0, "train_reward": [[1, 0.5]]}  # fmt: skip


def test_smollm2_report_pairs_seeds_picks_the_best_channel_on_validation_and_states_verdicts(tmp_path, bench):
    """The report of compare_smollm2.py from synthetic cells: comparison 4's "best single channel" is chosen on the
    validation split (here the worst on held-out), the paired statistics are paired_stats' on the seeds both arms
    finished, the pilot's seeds-needed appear once every arm has the 6 pilot seeds, and the README block says
    "not distinguishable" where the CI contains 0."""
    cmp, ps = bench.compare_smollm2, bench.paired_stats
    base = {a.name: 0.30 for a in cmp.ARMS}
    base.update({"composer": 0.40, "grpo+replay": 0.10})  # grpo+replay: best on validation, worst on held-out
    wobble = [0.0, 0.02, -0.01, 0.03, -0.02, 0.01]
    cells = [_cell(a, s, base[a] + wobble[s] * (a == "composer"), 0.9 if a == "grpo+replay" else 0.2)
             for a in base for s in range(6)]  # fmt: skip
    meta = {"command": "x", "seeds": list(range(8)), "design": {}, "machine": {}}
    rep = cmp.report(cells[:-1], meta)  # composer seed 5 missing: the pilot is incomplete
    assert rep["status"] == "pilot incomplete: 47 of 48 pilot cells finished" and not rep["pilot"]["complete"]
    rep = cmp.report(cells, meta)
    assert rep["best_single_channel"] == "grpo+replay"
    assert rep["status"] == "pilot complete; 48 of 64 cells of the 8-seed design finished"
    c1, _, _, c4 = rep["comparisons"]
    expected = ps.paired_comparison(
        "composer", {s: 0.40 + wobble[s] for s in range(6)}, "grpo", dict.fromkeys(range(6), 0.30)
    )
    assert c1["mean"] == pytest.approx(expected.mean) and c1["t_ci"] == pytest.approx(expected.t_ci)
    assert c1["verdict"] == expected.verdict and "composer beats grpo" in c1["verdict"]
    assert c4["b"] == "grpo+replay" and c4["verdict"].endswith(
        "(best single channel by validation: grpo+replay)"
    )
    assert rep["pilot"]["comparisons"]["composer − grpo"]["seeds_needed"] == ps.seeds_needed(expected.sd)
    same = rep["comparisons"][1]  # sdpo (success + feedback) − trl sdpo (feedback): identical scores
    assert same["mean"] == 0 and "not distinguishable" in same["verdict"]
    rep["machine"] = {"cpu": "cpu", "cpu_count": 2, "threads": 2, "load_average": [1.0, 1.0, 1.0]}
    rep["design"] = {"model": "m", "steps": 16, "dtype": "bf16", "device": "cpu", "held_out": 256, "validation": 128,
                     "trainer": {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 48,
                                 "learning_rate": 2e-5}}  # fmt: skip
    (tmp_path / "c.json").write_text(json.dumps(rep))
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{cmp.BEGIN}\nold\n{cmp.END}\nb\n")
    cmp.update_readme(readme, tmp_path / "c.json")
    text = readme.read_text()
    assert "old" not in text and "**pilot complete; 48 of 64" in text and c1["verdict"] in text
    assert f"- {same['verdict']}" in text and "seeds needed to detect 0.05" in text


def test_smollm2_device_cuda_without_a_gpu_exits_2(bench, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit) as e:
        bench.compare_smollm2.main(["--device", "cuda"])
    assert e.value.code == 2 and "--device cuda: torch sees no CUDA device" in capsys.readouterr().err
