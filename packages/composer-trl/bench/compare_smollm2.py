"""The real-model comparison, pre-registered (issue 59): SmolLM2-135M-Instruct on two-digit addition, every arm
paired over seeds on one fixed held-out set.

The design, the arms and the four comparisons that decide are written in the package README's "Pre-registered
comparisons" (committed before any cell ran). Arms (:data:`ARMS`):

=========================  ===============================================================  ======================
arm                        what it is                                                       sees reference answers
=========================  ===============================================================  ======================
grpo                       plain TRL ``GRPOTrainer``                                        no
grpo+sft                   GRPO + 1.0 x SFT on the reference answer (information-matched)   yes (SFT target)
grpo+replay                GRPO + channel 3 alone, on-policy pairs: chosen = the reference  yes (chosen side)
                           answer, rejected = each failed completion of the group (SimPO)
sdpo (success)             GRPO + channel 2, successful siblings as teacher context, EMA    no
sdpo (success + feedback)  the same + the verifier's feedback on each failed completion     no (feedback)
trl sdpo                   TRL's ``SDPOTrainer``, its own defaults (:data:`TRL_SDPO`)       no
trl sdpo (feedback)        the same with the verifier's feedback as environment feedback   no (feedback)
composer                   all three channels (channel 2 as sdpo (success + feedback),      yes (chosen side)
                           channel 3 as grpo+replay)
=========================  ===============================================================  ======================

Each (arm, seed) cell is its own process (its peak resident memory is that process's), writes
``cells/<arm>--seed<k>.cell.json`` atomically when it finishes and is skipped on a rerun, so the design fills over
several sittings; a cell run twice gives the same scores (fixed seed, fixed threads, greedy evaluation). The step-0
evaluation is the same model for every arm: it is one cell (``cells/step0.cell.json``), computed once and reused.
After every cell ``comparison-smollm2.json`` is rebuilt: per arm the final held-out and validation scores (per
prompt too), the training curves, seconds per step, peak memory and the machine's load; per pre-registered
comparison the paired statistics of ``paired_stats.py``; from the 6-seed pilot the paired SD and the seeds each
comparison needs to detect 0.05.

    python packages/composer-trl/bench/compare_smollm2.py                  # the 6-seed pilot, every arm
    python packages/composer-trl/bench/compare_smollm2.py --seeds 20       # extend the design
    python packages/composer-trl/bench/compare_smollm2.py --device cuda --output_dir runs/compare-smollm2-cuda
    python packages/composer-trl/bench/compare_smollm2.py readme           # README block from the committed JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _compare import (
    GRPOPlusSFTTrainer,
    cpu_has_bf16,
    fill_block,
    greedy_scores,
    machine,
    read_cells,
    spawn,
    stats,
)
from _compare import write_json as _write_json
from paired_stats import paired_comparison, t_quantile

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Arm:
    name: str
    kind: str  # grpo | sft | composer | trl_sdpo
    sees: str
    overrides: dict[str, Any] = field(default_factory=dict)
    feedback: bool = False


_SDPO = {"alpha_sdpo": 1.0, "beta_replay": 0.0, "sdpo_teacher": "ema", "sdpo_teacher_context": "success"}
_FEEDBACK = {**_SDPO, "sdpo_teacher_context": "success+feedback"}
REPLAY: dict[str, Any] = {"beta_replay": 1.0, "dpo_variant": "simpo", "replay_pairs": "on_policy"}
"""Channel 3 in this design: on-policy pairs (chosen = the row's reference answer, rejected = each failed completion
of the group), SimPO — length-normalised and reference-free: the two sides differ in length (a failure may run to
the budget, the reference is one short line), and SimPO needs no reference model's forward."""
TRL_SDPO: dict[str, Any] = {}
"""Options set on TRL's ``SDPOConfig`` besides the shared trainer settings: none — its own aggregation, templates and
defaults (``distillation_weight=1.0``, ``distillation_mode='sampled_token'``, EMA teacher at 0.05, successful
siblings as teachers, its reprompt/solution/feedback templates)."""
TRL_SDPO_FEEDBACK: dict[str, Any] = {"include_environment_feedback": True}
"""The one option set for ``trl sdpo (feedback)``: TRL's switch for environment feedback in the teacher prompt
(formatted by its own ``feedback_template``)."""

ARMS = (
    Arm("grpo", "grpo", "no"),
    Arm("grpo+sft", "sft", "yes (SFT target)"),
    Arm("grpo+replay", "composer", "yes (chosen side)", {"alpha_sdpo": 0.0, **REPLAY}),
    Arm("sdpo (success)", "composer", "no", _SDPO),
    Arm("sdpo (success + feedback)", "composer", "no (feedback)", _FEEDBACK, feedback=True),
    Arm("trl sdpo", "trl_sdpo", "no", TRL_SDPO),
    Arm("trl sdpo (feedback)", "trl_sdpo", "no (feedback)", TRL_SDPO_FEEDBACK, feedback=True),
    Arm("composer", "composer", "yes (chosen side)", {**_FEEDBACK, **REPLAY}, feedback=True),
)
SINGLE = ("sdpo (success)", "sdpo (success + feedback)", "grpo+replay")
"""The single added channels; comparison 4's "best" is the one with the highest mean final validation exact match."""
BEST = "best single channel"
COMPARISONS = (
    ("composer", "grpo"),
    ("sdpo (success + feedback)", "trl sdpo (feedback)"),
    ("grpo+replay", "grpo+sft"),
    ("composer", BEST),
)
"""The pre-registered comparisons (A − B), in the README's order."""

COMMON: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    "learning_rate": 2e-5,
    "lr_scheduler_type": "constant",
    "beta": 0.0,
    "loss_type": "dapo",
    "temperature": 1.0,
    "max_grad_norm": 1.0,
    "logging_steps": 1,
}
"""Trainer settings shared by every arm (the completion budget comes from the task: :func:`budget`)."""
LR_REASON = (
    "one learning rate (2e-5, constant) and one weight 1.0 for every added term (alpha_sdpo, beta_replay, the SFT "
    "weight) for every arm: a per-arm grid on the validation split would multiply the compute of every cell by the "
    "grid's size, so the previous design's value was fixed before any arm of this design ran; nothing is tuned on "
    "the held-out set"
)
STEPS, PILOT_SEEDS = 16, 6
QUICK = {"steps": 1, "held_out": 4, "validation": 4, "per_device_train_batch_size": 4, "num_generations": 2,
         "max_completion_length": 8}  # fmt: skip
MODEL = "smollm2-135m-instruct"


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# ------------------------------------------------------------------------------------------------ the task


def budget() -> int:
    """The completion budget: ``chosen_budget`` of ``results/addition_budget.json`` (``addition_budget.py``: the
    smallest budget at which ≤ 10 % of the base model's greedy validation answers are cut off)."""
    path = HERE / "results" / "addition_budget.json"
    if not path.is_file():
        raise SystemExit(
            f"compare_smollm2: {path} is missing; run bench/addition_budget.py first (or pass --budget)"
        )
    return int(json.loads(path.read_text())["chosen_budget"])


def task_rows(seed: int, n_train: int) -> tuple[list[dict[str, Any]], list[Any], list[Any]]:
    """``(training rows of this seed, the fixed held-out prompts, the validation prompts)``
    (:func:`composer_core.tasks.addition.task_splits`: the same held-out and validation sums for every seed)."""
    from composer_core.tasks.addition import task_splits

    s = task_splits(seed, n_train)
    train = [
        {"prompt": r["prompt"], "chosen": r["chosen"]} for r in s.train
    ]  # on-policy pairs: no `rejected`
    return train, [r["prompt"] for r in s.held_out], [r["prompt"] for r in s.validation]


# ------------------------------------------------------------------------------------------------ one cell


def _feedback_sdpo() -> Any:
    """TRL's ``SDPOTrainer`` given the verifier's feedback on each completion as its environment feedback.

    TRL 1.16 reads environment feedback from the batch rows' ``privileged_context`` right after its rollout
    (``_prepare_training_batch``), a dataset column fixed before the completion exists; this writes the verifier's
    feedback on each completion into that field after generation. Everything else is ``SDPOTrainer``'s own.
    """
    from composer_core.tasks.addition import feedback
    from trl.experimental.sdpo import SDPOTrainer

    class _FeedbackSDPOTrainer(SDPOTrainer):  # type: ignore[misc]
        def sample_rollouts(self, inputs: list[dict[str, Any]]) -> Any:
            batch = super().sample_rollouts(inputs)
            texts = self.processing_class.batch_decode(batch["completion_ids"], skip_special_tokens=True)
            for i, (row, text) in enumerate(zip(inputs, texts, strict=True)):
                inputs[i] = {**row, "privileged_context": feedback(row["prompt"], text)}
            return batch

    return _FeedbackSDPOTrainer


def _trainer(spec: dict[str, Any], arm: Arm, model: Any, tok: Any, train: list[dict[str, Any]]) -> Any:
    from composer_core.tasks.addition import addition_feedback, addition_reward
    from composer_trl.config import ComposerGRPOConfig
    from composer_trl.job import run_args
    from composer_trl.trainer import ComposerGRPOTrainer
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    common = {
        **COMMON,
        **spec["trainer"],
        **run_args(spec["work_dir"], spec["steps"], spec["seed"], spec["device"] == "cpu"),
        "bf16": spec["bf16"],
    }
    kw: dict[str, Any] = {
        "model": model,
        "reward_funcs": [addition_reward],
        "train_dataset": Dataset.from_list(train),
        "processing_class": tok,
    }
    if arm.kind == "trl_sdpo":
        from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

        cls = _feedback_sdpo() if arm.feedback else SDPOTrainer
        return cls(args=SDPOConfig(**common, **arm.overrides), **kw)
    if arm.kind == "composer":
        extra = {"hint_fn": addition_feedback} if arm.feedback else {}
        # the per-channel gradient norms are curves of every composer cell (off by default: one extra backward per
        # channel at each logging step, which these cells' seconds per step include)
        options = {"log_channel_grad_norms": True, **arm.overrides}
        return ComposerGRPOTrainer(args=ComposerGRPOConfig(**common, **options), **kw, **extra)
    return (GRPOPlusSFTTrainer if arm.kind == "sft" else GRPOTrainer)(args=GRPOConfig(**common), **kw)


CURVES = {
    "train_reward": ("reward", "self_distillation/reward_mean"),
    "grad_norm": ("grad_norm",),
    "grad_norm_policy": ("composer/grad_norm/policy",),
    "grad_norm_sdpo": ("composer/grad_norm/sdpo",),
    "grad_norm_replay": ("composer/grad_norm/replay",),
    "replay_loss": ("composer/loss/replay",),
    "sdpo_loss": ("composer/loss/sdpo", "self_distillation/distillation_loss"),
    "sft_nll": ("sft/nll",),
    "clipped_ratio": ("completions/clipped_ratio",),
}
"""Per-step curves a cell stores: its key → the logged metric names that hold it (the first present wins)."""


def _curves(logs: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for key, names in CURVES.items():
        for name in names:
            pts = [(int(r["step"]), float(r[name])) for r in logs if "step" in r and r.get(name) is not None]
            if pts:
                out[key] = pts
                break
    return out


def _model(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, autocast context for the evaluation)`` of a cell."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(int(spec["threads"]))
    tok = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).to(spec["device"])
    device_type = "cuda" if spec["device"].startswith("cuda") else "cpu"
    autocast = torch.autocast(device_type, dtype=torch.bfloat16) if spec["bf16"] else None
    return model, tok, autocast


def _evaluate(spec: dict[str, Any], model: Any, tok: Any, autocast: Any) -> dict[str, Any]:
    from composer_core.tasks.addition import verify

    _, held, val = task_rows(0, 1)
    held, val = held[: spec["held_out"]], val[: spec["validation"]]
    budget_ = int(spec["trainer"]["max_completion_length"])
    return {
        "held_out": greedy_scores(model, tok, held, budget_, verify, autocast=autocast),
        "validation": greedy_scores(model, tok, val, budget_, verify, autocast=autocast),
    }


def run_cell(spec_path: str) -> int:
    """One cell described by the JSON at ``spec_path`` (an arm × seed, or ``step 0``); writes its result JSON."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    load_start = os.getloadavg()
    model, tok, autocast = _model(spec)
    result: dict[str, Any] = {"arm": spec["arm"], "seed": spec["seed"]}
    if spec["arm"] != "step 0":
        arm = next(a for a in ARMS if a.name == spec["arm"])
        need = int(spec["trainer"]["per_device_train_batch_size"]) // int(spec["trainer"]["num_generations"])
        train, _, _ = task_rows(spec["seed"], need * spec["steps"])
        trainer = _trainer(spec, arm, model, tok, train)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        result.update(train_seconds=wall, seconds_per_step=wall / spec["steps"])
        result.update(_curves(trainer.state.log_history))
        model = trainer.model
    evals = _evaluate(spec, model, tok, autocast)
    result.update(evals, eval_seconds=sum(e["seconds"] for e in evals.values()))
    if torch.cuda.is_available() and spec["device"].startswith("cuda"):
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    result["machine"] = {**machine(int(spec["threads"])), "load_average_start": list(load_start)}
    _write_json(_child_result(spec), result)  # the parent adds the peak memory and writes the cell
    return 0


def _child_result(spec: dict[str, Any]) -> Path:
    return Path(spec["result"]).with_suffix(".child.json")


def spawn_cell(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Run one cell in a child process; its result with the child's peak resident memory (MiB) added."""
    stem = Path(spec["result"]).name.removesuffix(".cell.json")
    spec_path = folder / f"{stem}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log = folder / f"{stem}.log"
    code, rss = spawn([str(HERE / "compare_smollm2.py"), "cell", str(spec_path)], log)
    if code != 0:
        raise RuntimeError(
            f"cell {spec['arm']!r} seed {spec['seed']} failed (exit {code}):\n{log.read_text()[-3000:]}"
        )
    cell = json.loads(_child_result(spec).read_text())
    cell["peak_rss_mib"] = rss
    _write_json(Path(spec["result"]), cell)  # atomically: a cell file exists only when complete
    _child_result(spec).unlink()
    return dict(cell)


# ------------------------------------------------------------------------------------------------ the report


def ci95(values: list[float]) -> list[float] | None:
    """The t interval of a mean (``paired_stats.t_quantile``); None below 2 values."""
    if len(values) < 2:
        return None
    s = stats(values)
    half = t_quantile(0.975, len(values) - 1) * s["std"] / math.sqrt(len(values))
    return [s["mean"] - half, s["mean"] + half]


def _arm_summary(arm: Arm, cells: list[dict[str, Any]]) -> dict[str, Any]:
    em = [c["held_out"]["exact_match"] for c in cells]
    return {
        "sees_reference_answers": arm.sees,
        "n": len(cells),
        "seeds_finished": [c["seed"] for c in cells],
        "final_exact_match": {**stats(em), "ci95": ci95(em)},
        "final_partial_credit": stats([c["held_out"]["partial_credit"] for c in cells]),
        "final_truncated": stats([c["held_out"]["truncated"] for c in cells]),
        "validation_exact_match": stats([c["validation"]["exact_match"] for c in cells]),
        "seconds_per_step": stats([c["seconds_per_step"] for c in cells]),
        "eval_seconds": stats([c["eval_seconds"] for c in cells]),
        "peak_rss_mib": stats([c.get("peak_rss_mib") for c in cells]),
        "cells": cells,
    }


def _best_single(arms: dict[str, Any]) -> str | None:
    """Of :data:`SINGLE`, the arm with the highest mean final validation exact match (ties: the first)."""
    done = [a for a in SINGLE if a in arms]
    return (
        max(done, key=lambda a: (arms[a]["validation_exact_match"]["mean"], -SINGLE.index(a)))
        if done
        else None
    )


def _scores(arm: dict[str, Any], seeds: int | None = None) -> dict[int, float]:
    return {
        c["seed"]: c["held_out"]["exact_match"] for c in arm["cells"] if seeds is None or c["seed"] < seeds
    }


def _comparisons(arms: dict[str, Any], best: str | None) -> list[dict[str, Any]]:
    out = []
    for a, b in COMPARISONS:
        b_arm = best if b == BEST else b
        row: dict[str, Any] = {"name": f"{a} − {b}", "a": a, "b": b_arm}
        if (
            b_arm is None
            or a not in arms
            or b_arm not in arms
            or not set(_scores(arms[a])) & set(_scores(arms[b_arm]))
        ):
            row["verdict"] = f"{a} − {b}: not computed yet (no seed finished by both arms)"
        else:
            row.update(paired_comparison(a, _scores(arms[a]), b_arm, _scores(arms[b_arm])).as_dict())
            if b == BEST:
                row["verdict"] = f"{row['verdict']} (best single channel by validation: {b_arm})"
        out.append(row)
    return out


def _pilot(arms: dict[str, Any], best: str | None) -> dict[str, Any]:
    """Paired SD and seeds needed per comparison from the pilot seeds (0 .. PILOT_SEEDS-1), once every arm has them."""
    pilot = set(range(PILOT_SEEDS))
    if any(arm.name not in arms or not pilot <= set(_scores(arms[arm.name])) for arm in ARMS):
        return {"complete": False, "seeds": sorted(pilot)}
    rows = {}
    for a, b in COMPARISONS:
        b_arm = best if b == BEST else b
        assert b_arm is not None
        pc = paired_comparison(a, _scores(arms[a], PILOT_SEEDS), b_arm, _scores(arms[b_arm], PILOT_SEEDS))
        rows[f"{a} − {b}"] = {"b": b_arm, "paired_sd": pc.sd, "seeds_needed": pc.seeds_needed}
    need = max(r["seeds_needed"] or 0 for r in rows.values())
    return {"complete": True, "seeds": sorted(pilot), "comparisons": rows, "seeds_needed_max": need}


def report(cells: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """``comparison-smollm2.json`` from the finished cells (arms in :data:`ARMS` order; arms without cells absent)."""
    step0 = next((c for c in cells if c["arm"] == "step 0"), None)
    arms: dict[str, Any] = {}
    for arm in ARMS:
        mine = sorted(
            (c for c in cells if c["arm"] == arm.name and c["seed"] in meta["seeds"]), key=lambda c: c["seed"]
        )
        if mine:
            arms[arm.name] = _arm_summary(arm, mine)
    best = _best_single(arms)
    total = len(ARMS) * len(meta["seeds"])
    done = sum(a["n"] for a in arms.values())
    pilot = _pilot(arms, best)
    if not pilot["complete"]:
        status = f"pilot incomplete: {sum(min(a['n'], PILOT_SEEDS) for a in arms.values())} of {len(ARMS) * PILOT_SEEDS} pilot cells finished"
    elif done < total:
        status = f"pilot complete; {done} of {total} cells of the {len(meta['seeds'])}-seed design finished"
    else:
        status = f"every cell of the {len(meta['seeds'])}-seed design finished"
    return {**meta, "status": status, "step0": step0, "best_single_channel": best, "arms": arms,
            "comparisons": _comparisons(arms, best), "pilot": pilot}  # fmt: skip


# ------------------------------------------------------------------------------------------------ README


def _f(x: float | None, spec: str = ".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec).replace("-", "−")


def table(rep: dict[str, Any]) -> str:
    d = rep["design"]
    s0 = rep.get("step0")
    start = "not evaluated yet" if s0 is None else (
        f"{_f(s0['held_out']['exact_match'])} held-out exact match, {_f(s0['validation']['exact_match'])} validation, "
        f"{s0['held_out']['truncated']:.0%} of greedy answers cut off at the budget"
    )  # fmt: skip
    lines = [
        f"{d['model']}, two-digit addition, {d['steps']} steps of {d['trainer']['per_device_train_batch_size']} "
        f"completions ({d['trainer']['num_generations']} per prompt, ≤ {d['trainer']['max_completion_length']} tokens), "
        f"learning rate {d['trainer']['learning_rate']}, {d['dtype']} on {d['device']}; greedy on the fixed "
        f"{d['held_out']} held-out sums (validation: {d['validation']}). Step 0 (the same model for every arm, "
        f"evaluated once): {start}.",
        "",
        "| arm | sees reference answers | n | final exact match (mean ± sd) | 95% CI | partial credit | validation exact match | s / step | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if not rep["arms"]:
        lines.append("| (no cell finished yet) |" + " |" * 8)
    for name, a in rep["arms"].items():
        em, ci = a["final_exact_match"], a["final_exact_match"]["ci95"]
        lines.append(
            f"| {name} | {a['sees_reference_answers']} | {a['n']} | {_f(em['mean'])} ± {_f(em['std'])} | "
            f"{'–' if ci is None else _f(ci[0]) + '…' + _f(ci[1])} | {_f(a['final_partial_credit']['mean'])} | "
            f"{_f(a['validation_exact_match']['mean'])} | {_f(a['seconds_per_step']['mean'], '.1f')} | "
            f"{_f(a['peak_rss_mib']['mean'], '.0f')} |"
        )
    lines += ["", "| pre-registered comparison (A − B) | n | mean difference | 95% CI (t) | paired SD | seeds for 0.05 at 80% power |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for c in rep["comparisons"]:
        ci = c.get("t_ci")
        lines.append(
            f"| {c['a']} − {c['b'] or BEST} | {len(c.get('seeds', []))} | "
            f"{_f(c.get('mean'))} | {'–' if ci is None else _f(ci[0]) + '…' + _f(ci[1])} | {_f(c.get('sd'))} | "
            f"{c.get('seeds_needed') or '–'} |"
        )
    lines += ["", *(f"- {c['verdict']}" for c in rep["comparisons"])]
    return "\n".join(lines) + "\n"


def _pilot_line(rep: dict[str, Any]) -> str:
    p = rep["pilot"]
    if not p["complete"]:
        return f"The seeds each comparison needs are computed when the {PILOT_SEEDS}-seed pilot is complete."
    need = ", ".join(
        f"{k}: {v['seeds_needed']} (paired SD {_f(v['paired_sd'])})" for k, v in p["comparisons"].items()
    )
    return f"From the {PILOT_SEEDS}-seed pilot, seeds needed to detect 0.05 at 80 % power: {need}."


BEGIN, END = "<!-- real-comparison:begin -->", "<!-- real-comparison:end -->"
RESULTS = HERE / "results" / "comparison-smollm2.json"
README = HERE.parent / "README.md"


def update_readme(readme: str | Path = README, comparison: str | Path = RESULTS) -> None:
    """Fill the README block between :data:`BEGIN` and :data:`END` from ``comparison-smollm2.json`` (never typed by
    hand): ``python packages/composer-trl/bench/compare_smollm2.py readme [README.md] [comparison-smollm2.json]``."""
    rep = json.loads(Path(comparison).read_text())
    m = rep["machine"]
    block = (
        f"Generated by `compare_smollm2.py readme` from `bench/results/comparison-smollm2.json` of `{rep['command']}` "
        f"(**{rep['status']}**; {m['cpu']}, {m['cpu_count']} cores, torch threads {m['threads']}, load average "
        f"{m['load_average'][0]:.1f} when the JSON was written).\n\n"
        + table(rep)
        + "\n"
        + _pilot_line(rep)
        + "\n"
    )
    fill_block(readme, BEGIN, END, block)


# ------------------------------------------------------------------------------------------------ the design


def _design(args: argparse.Namespace) -> dict[str, Any]:
    sizes = dict(QUICK) if args.quick else {"steps": STEPS, "held_out": None, "validation": None}
    trainer = {**COMMON, **{k: v for k, v in sizes.items() if k not in ("steps", "held_out", "validation")}}
    if "max_completion_length" not in trainer:
        trainer["max_completion_length"] = args.budget or budget()
    _, held, val = task_rows(0, 1)
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and (args.device != "cpu" or cpu_has_bf16()))
    return {
        "model": args.model, "steps": sizes["steps"], "trainer": trainer,
        "held_out": sizes["held_out"] or len(held), "validation": sizes["validation"] or len(val),
        "device": args.device, "dtype": "bf16" if bf16 else "float32", "threads": args.threads, "quick": args.quick,
        "learning_rate_reason": LR_REASON, "replay": {**REPLAY, "why": _REPLAY_WHY},
        "trl_sdpo_options": {"trl sdpo": TRL_SDPO, "trl sdpo (feedback)": TRL_SDPO_FEEDBACK, "why": _TRL_WHY},
        "step0_note": "the step-0 evaluation is the same model for every arm: computed once (cells/step0) and reused",
        "arms": {a.name: {"kind": a.kind, "options": a.overrides, "verifier_feedback": a.feedback} for a in ARMS},
    }  # fmt: skip


_REPLAY_WHY = (
    "SimPO: the pair's sides differ in length (a failed completion may run to the budget, the reference answer is "
    "one short line) and SimPO's margin is length-normalised; it needs no reference model's forward"
)
_TRL_WHY = (
    "TRL's SDPOTrainer runs with its own aggregation, templates and defaults; only the shared trainer settings are "
    "matched; with feedback, include_environment_feedback=True and the verifier's feedback on each completion is "
    "written into the batch rows' privileged_context after the rollout (TRL 1.16 reads it there; a dataset column "
    "cannot hold feedback on a completion that does not exist yet)"
)


def _model_dir(name: str) -> str:
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    from composer_trl.models import packaged_model_dir

    return str(packaged_model_dir(name))


def _check_design(out: Path, design: dict[str, Any]) -> None:
    """A rerun into ``out`` must be the same design (only the seeds may grow): cells of two designs never mix."""
    path = out / "design.json"
    if path.is_file():
        old = json.loads(path.read_text())
        keys = [k for k in design if k != "threads" and old.get(k) != design[k]]
        if keys:
            raise SystemExit(f"compare_smollm2: {out} holds cells of another design ({', '.join(keys)} differ); "
                             "pass another --output_dir")  # fmt: skip
    else:
        _write_json(path, design)


def run(args: argparse.Namespace) -> int:
    out = Path(args.output_dir)
    folder = out / "cells"
    folder.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(args.model)
    design = _design(args)
    _check_design(out, design)
    meta = {
        "command": "python packages/composer-trl/bench/compare_smollm2.py" + (" --quick" if args.quick else "")
        + f" --seeds {args.seeds}" + (f" --device {args.device}" if args.device != "cpu" else ""),
        "design": design, "seeds": list(range(args.seeds)), "machine": machine(args.threads),
    }  # fmt: skip
    todo = [("step 0", 0)] + [(a.name, s) for s in range(args.seeds) for a in ARMS]
    shard, shards = args.shard
    for k, (arm, seed) in enumerate(todo):
        if (k + seed) % shards != shard:  # + seed: each shard gets every arm over the seeds
            continue
        result = folder / ("step0.cell.json" if arm == "step 0" else f"{_slug(arm)}--seed{seed}.cell.json")
        if result.is_file():
            print(
                f"[compare_smollm2] {k}/{len(todo) - 1} {arm} seed {seed}: finished earlier, kept", flush=True
            )
            continue
        if args.dry_run:
            continue
        spec = {"arm": arm, "seed": seed, "model": model_dir, "steps": design["steps"], "trainer": design["trainer"],
                "held_out": design["held_out"], "validation": design["validation"], "threads": args.threads,
                "device": args.device, "bf16": design["dtype"] == "bf16", "result": str(result),
                "work_dir": str(out / "work" / result.name.removesuffix(".cell.json"))}  # fmt: skip
        started = time.perf_counter()
        cell = spawn_cell(spec, folder)
        print(f"[compare_smollm2] {k}/{len(todo) - 1} {arm} seed {seed}: done in {time.perf_counter() - started:.0f} s "
              f"({cell.get('seconds_per_step', 0):.1f} s/step, eval {cell['eval_seconds']:.0f} s, peak RSS "
              f"{cell['peak_rss_mib']:.0f} MiB), held-out exact match {cell['held_out']['exact_match']:.3f}, "
              f"validation {cell['validation']['exact_match']:.3f}", flush=True)  # fmt: skip
        _write(out, meta)
    rep = _write(out, meta)
    print(f"\n[compare_smollm2] {rep['status']}\n" + table(rep) + "\n" + _pilot_line(rep))
    if not args.no_plot:
        print(f"plot: {plot(rep, out / 'comparison-smollm2.png').resolve()}")
    print(f"json: {(out / 'comparison-smollm2.json').resolve()}")
    return 0


def plot(rep: dict[str, Any], path: Path) -> Path:
    """``comparison-smollm2.json`` as a PNG: each arm's final held-out exact match per seed (dots) with its mean and
    95% CI (bar) beside step 0 (dashed); each pre-registered comparison's paired differences per seed with their
    mean and t CI against 0."""
    from composer_trl.plot import _save, require_matplotlib

    plt = require_matplotlib()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 8))
    names = list(rep["arms"])
    for i, name in enumerate(names):
        arm = rep["arms"][name]
        scores = [c["held_out"]["exact_match"] for c in arm["cells"]]
        top.scatter([i] * len(scores), scores, s=14, color=f"C{i}", alpha=0.6)
        _mean_bar(
            top, i + 0.15, arm["final_exact_match"]["mean"], arm["final_exact_match"]["ci95"], f"C{i}", "y"
        )
    top.axhline(rep["step0"]["held_out"]["exact_match"], color="grey", linestyle="--", label="step 0")
    labels = [f"{n} (n={rep['arms'][n]['n']})" for n in names]
    top.set_xticks(range(len(names)), labels, fontsize=7, rotation=20, ha="right")
    top.set_ylabel("final held-out exact match")
    top.set_title("per arm: seeds (dots), mean and 95% CI (bar)", fontsize=9)
    top.legend(fontsize=7)
    for j, c in enumerate(rep["comparisons"]):
        bottom.scatter(c["differences"], [j] * len(c["differences"]), s=14, color="C0", alpha=0.6)
        _mean_bar(bottom, j + 0.15, c["mean"], c["t_ci"], "k", "x")
    bottom.axvline(0.0, color="grey", linestyle="--")
    bottom.set_yticks(range(len(rep["comparisons"])), [c["name"] for c in rep["comparisons"]], fontsize=7)
    bottom.set_xlabel("paired difference in final held-out exact match (A − B)")
    bottom.set_title("pre-registered comparisons: per-seed differences, mean and 95% t CI", fontsize=9)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return Path(_save(plt, fig, path))


def _mean_bar(ax: Any, at: float, mean: float | None, ci: list[float] | None, color: str, axis: str) -> None:
    """A mean with its CI as an error bar along ``axis`` ("y" or "x") at position ``at`` (one seed: no interval)."""
    if mean is None:
        return
    lo, hi = ci or (mean, mean)
    err = {f"{axis}err": [[mean - lo], [hi - mean]]}
    xy = ([at], [mean]) if axis == "y" else ([mean], [at])
    ax.errorbar(*xy, fmt="o", color=color, capsize=4, **err)


def _write(out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    rep = report(read_cells(out / "cells"), {**meta, "machine": machine(meta["machine"]["threads"])})
    _write_json(out / "comparison-smollm2.json", rep)
    return rep


def _shard(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise argparse.ArgumentTypeError(f"--shard takes I/N with 0 <= I < N (e.g. 0/2), got {text!r}")
    return int(i), int(n)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--seeds", type=int, default=PILOT_SEEDS, help=f"seeds 0 .. N-1 (default {PILOT_SEEDS}: the pilot)"
    )
    p.add_argument("--quick", action="store_true", help="1 step, 4 held-out and 4 validation sums (tests)")
    p.add_argument(
        "--output_dir", default="runs/compare-smollm2", help="cells/, design.json, comparison-smollm2.json"
    )
    p.add_argument("--model", default=MODEL, help="packaged model name or a local model directory")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: the same design on a GPU")
    p.add_argument("--dtype", choices=("auto", "bf16", "float32"), default="auto",
                   help="auto: bf16 on CUDA or where /proc/cpuinfo has avx512_bf16, else float32")  # fmt: skip
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads per cell")
    p.add_argument("--budget", type=int, default=None,
                   help="completion tokens (default: chosen_budget of results/addition_budget.json, the design's)")  # fmt: skip
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N",
                   help="run only cells k with (k + seed) %% N == I (N processes fill one --output_dir side by side)")  # fmt: skip
    p.add_argument("--no_plot", action="store_true", help="skip comparison-smollm2.png")
    p.add_argument(
        "--dry_run", action="store_true", help="run no cell: rebuild the JSON from the cells present"
    )
    return p


def main(argv: list[str]) -> int:
    if argv[:1] == ["cell"]:
        return run_cell(argv[1])
    if argv[:1] == ["readme"]:
        update_readme(*argv[1:3])
        return 0
    args = parser().parse_args(argv)
    if args.seeds < 1:
        parser().error(f"--seeds must be >= 1, got {args.seeds}")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser().error(
                "--device cuda: torch sees no CUDA device (run without --device for the CPU design)"
            )
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
