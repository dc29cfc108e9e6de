"""bench/addition_budget.py: the completion-budget measurement counts a reply as truncated exactly when it has
not emitted EOS within the budget, scores the reply cut at that budget, and runs end to end (``--small``)."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from composer_testkit.bench import load_bench_json, run_small_bench

BENCH = Path(__file__).resolve().parents[1] / "bench" / "addition_budget.py"


def test_truncation_exact_match_and_no_answer_at_each_budget(addition_budget: Any) -> None:
    from composer_core.tasks.tiny import build_char_tokenizer

    tok = build_char_tokenizer(string.ascii_letters + string.digits + " .,+=\n", chatml=True)
    eos = tok.eos_token_id
    prompts = [[{"role": "user", "content": "Compute 34 + 44. Reply with just the result."}]] * 3
    replies = ["34 + 44 = 78", "78", "To compute 34 + 44, add"]
    ids = [[*tok.encode(r, add_special_tokens=False), eos] for r in replies[:2]]
    ids.append(tok.encode(replies[2], add_special_tokens=False))  # never ended: truncated at every budget
    full = addition_budget.score(tok, prompts, ids, 64, {eos})
    assert full == {"budget": 64, "n": 3, "truncated": 1 / 3, "exact_match": 2 / 3, "no_answer": 1 / 3}
    # 3 tokens: "34 " (cut, no answer), "78" + EOS (ended, right), "To " (cut, no answer)
    short = addition_budget.score(tok, prompts, ids, 3, {eos})
    assert short == {"budget": 3, "n": 3, "truncated": 2 / 3, "exact_match": 1 / 3, "no_answer": 2 / 3}


def test_budget_script_runs_at_small_size(tmp_path: Path) -> None:
    run_small_bench(BENCH, tmp_path, args=("--threads", "1"))
    data = load_bench_json(tmp_path / "addition_budget.json")
    assert data["split_sizes"] == {"validation": 8, "held_out": 8}
    assert [r[:2] for r in data["readme"]["rows"]] == [
        ["validation", 4], ["validation", 8], ["held_out", 4], ["held_out", 8]
    ]  # fmt: skip
    assert data["prompt_chosen_on"] == "validation" and data["prompt_is_default"] is True
