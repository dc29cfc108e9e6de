"""composer_verl.envs: an environment (composer_core.envs) as verl's data, reward function and hint source."""

from __future__ import annotations

import pandas as pd
import pytest
from composer_core.tasks import digit_reversal as T
from composer_verl.config import ComposerVerlConfig
from composer_verl.envs import compute_score, env_hint_fn, env_rows, write_env_dataset

ACTOR = {"shuffle": False, "use_dynamic_bsz": False, "ppo_micro_batch_size_per_gpu": 4}


def test_rows_reward_and_hint_come_from_the_environment(tmp_path) -> None:
    rows = env_rows("digit-reversal", limit=4)
    assert len(rows) == 4
    r = rows[0]
    prompt = r["prompt"][-1]["content"]
    answer = T.oracle_solve(prompt)
    assert r["chosen"] == answer and r["rejected"] == T.wrong_solution(prompt)
    assert r["data_source"] == "digit-reversal" and r["extra_info"]["task_id"]
    wrong = answer[0] + "00"
    # verl's reward-function call: score = the task's partial credit, feedback = the verifier's hint
    out = compute_score(r["data_source"], wrong, r["reward_model"]["ground_truth"], r["extra_info"])
    assert out == {"score": T.verify(prompt, wrong), "feedback": T.feedback_hint(prompt, wrong)}
    assert compute_score("x", answer, None, r["extra_info"], env="digit-reversal") == {
        "score": 1.0,
        "feedback": "",
    }
    # the producers' hint: the environment's feedback on the response, None when it is right
    hint = env_hint_fn("digit-reversal")
    extra = {"extra_info": r["extra_info"], "reward_model": r["reward_model"]}
    assert hint(prompt, wrong, 0.0, extra) == T.feedback_hint(prompt, wrong)
    assert hint(prompt, answer, 1.0, extra) is None
    path = write_env_dataset("digit-reversal", tmp_path / "train.parquet", limit=4)
    assert pd.read_parquet(path)["chosen"].tolist() == [x["chosen"] for x in rows]


def test_rows_without_task_id_name_the_fix() -> None:
    with pytest.raises(ValueError, match="write_env_dataset"):
        compute_score("digit-reversal", "123", None, {"index": 0})


def test_env_option_replaces_hint_fn_and_needs_alpha() -> None:
    C = ComposerVerlConfig.from_mapping
    assert C({"env": "digit-reversal", "alpha_sdpo": 0.5}).hints
    with pytest.raises(ValueError, match="both set"):
        C({"hint_fn": "m:f", "env": "digit-reversal", "alpha_sdpo": 0.5})
    with pytest.raises(ValueError, match="alpha_sdpo"):
        C({"env": "digit-reversal"})
