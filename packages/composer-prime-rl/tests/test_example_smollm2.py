"""The SmolLM2-135M-Instruct recipe (``examples/smollm2-reverse-digits/rl.toml``) at a tiny size, without PRIME-RL.

What runs: ``python -m composer_prime_rl.check`` on the recipe (exit 0, channel 2 on); ``composer_loss`` called
with the recipe's ``[trainer.loss.kwargs]`` on tiny samples (one with hinted ``ref_logprobs``, one without them:
``sdpo_missing = "skip"``), value finite and a gradient; the ``[orchestrator.algo]`` table parsed by
``ComposerSDPOSettings`` (what ``composer_sdpo`` reads) and, on a real verifiers trace of the recipe's taskset
with a wrong answer, the hint is the taskset's feedback; the taskset id loads through verifiers.

What does not run: PRIME-RL's ``rl`` command (not installable here; its trainer and inference server need GPUs) and
SmolLM2's weights; the ``composer_sdpo`` config class in PRIME-RL's ``AlgoConfig`` union is the user's step.
"""

from __future__ import annotations

import math
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from composer_prime_rl import composer_loss, parse_options
from composer_prime_rl.orchestrator import ComposerSDPOSettings

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "smollm2-reverse-digits" / "rl.toml"


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    with RECIPE.open("rb") as fh:
        return tomllib.load(fh)


def test_check_accepts_the_recipe() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "composer_prime_rl.check", str(RECIPE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout and "alpha_sdpo=0.5" in out.stdout


def test_recipe_names_smollm2_and_composer(config: dict[str, Any]) -> None:
    assert config["model"]["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    loss = config["trainer"]["loss"]
    assert loss["type"] == "custom" and loss["import_path"] == "composer_prime_rl.composer_loss"
    assert config["orchestrator"]["algo"]["type"] == "composer_sdpo"


def test_loss_through_the_recipe_kwargs_on_a_tiny_batch(config: dict[str, Any], make_inputs) -> None:  # type: ignore[no-untyped-def]
    kwargs = config["trainer"]["loss"]["kwargs"]
    opts = parse_options(kwargs)
    assert opts.policy_loss == "dppo" and opts.config.alpha_sdpo == 0.5 and opts.sdpo_missing == "skip"
    hinted = make_inputs(
        p_train=[0.9, 0.5, 0.3], p_inf=[0.6, 0.6, 0.6], p_ref=[0.5, 0.4, 0.3], adv=[1.0, -0.5, 2.0]
    )
    out = composer_loss(hinted, **kwargs)
    assert math.isfinite(out.loss.item()) and out.metrics["composer/sdpo/skipped"].item() == 0.0
    assert out.metrics["composer/loss/sdpo"].item() != 0.0  # channel 2 contributes
    out.loss.backward()
    assert hinted.trainer_logprobs.grad is not None and hinted.trainer_logprobs.grad.abs().sum() > 0
    # a trace that got no hint (a right answer): no ref_logprobs, trained on channel 1 only
    plain = make_inputs(p_train=[0.9, 0.5], p_inf=[0.6, 0.6], adv=[1.0, 1.0])
    out = composer_loss(plain, **kwargs)
    assert math.isfinite(out.loss.item()) and out.metrics["composer/sdpo/skipped"].item() == 1.0


def test_orchestrator_algo_table_and_taskset(config: dict[str, Any]) -> None:
    import verifiers.v1 as vf
    from composer_core.tasks import digit_reversal as dr
    from composer_prime_rl.orchestrator import trace_hint_jobs
    from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

    algo = {k: v for k, v in config["orchestrator"]["algo"].items() if k != "type"}
    settings = ComposerSDPOSettings.from_config(algo)
    assert settings.hint_key == "feedback" and settings.sdpo_teacher == "live"

    taskset = dict(config["orchestrator"]["train"]["source"][0]["env"]["taskset"])
    ts_id = taskset.pop("id")
    tasks = list(load_taskset(taskset_config_type(ts_id)(id=ts_id, **{**taskset, "num_tasks": 2})))
    assert len(tasks) == 2
    prompt = str(tasks[0].data.prompt)
    # what the taskset's reward writes for a wrong answer is the hint composer_sdpo uses, through the template
    trace = type("Trace", (), {"info": {"feedback": dr.feedback_hint(prompt, "000")}})()
    (job,) = trace_hint_jobs(settings, None, None, [trace])
    hint = job.hint
    assert hint == settings.template.format(hint=dr.feedback_hint(prompt, "000"))
    assert isinstance(tasks[0], vf.Task)
