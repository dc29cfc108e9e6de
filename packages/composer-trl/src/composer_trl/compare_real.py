"""``composer-train --compare --model_name_or_path <real model>``: does the objective beat GRPO on a model that
can read its context, and how does it stand against TRL's own ``SDPOTrainer``, measured side by side.

The task is two-digit addition (:mod:`composer_core.tasks.addition`: partial-credit verifier, textual feedback,
held-out split, reference answers), chosen because SmolLM2-135M-Instruct starts low but not at zero on it.
Every run gets the same prompts, seeds, group size, completion length, optimiser, learning rate and steps, and is
evaluated greedily on the same held-out sums at step 0, along the way and at the end:

=========================  ==========================================================  ==========================
run                        what it is                                                  sees reference answers
=========================  ==========================================================  ==========================
grpo                       plain TRL ``GRPOTrainer``                                   no
sdpo (success)             GRPO + channel 2, successful siblings as the only teacher   no
                           context (EMA teacher): the paper's scalar-reward setting
sdpo (success + feedback)  the same + the verifier's feedback on each failed answer    no
composer                   all three channels (channel 3's pairs: reference answer     yes (replay pairs)
                           vs the no-carry sum)
grpo+sft                   GRPO + SFT on the reference answers (information-matched)   yes (SFT targets)
trl sdpo                   TRL 1.16 ``trl.experimental.sdpo.SDPOTrainer``, options      no
                           matched to "sdpo (success)" (see :data:`TRL_SDPO`)
=========================  ==========================================================  ==========================

Each (run, seed) cell runs in its own process (its peak resident memory is that process's) and writes
``cells/<run>--seed<k>.json`` as soon as it finishes; a rerun into the same output directory skips finished
cells, so the table can be filled over several sittings. ``comparison.json``, ``comparison.md`` and
``comparison.png`` are rebuilt from the cells present after every cell.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_trl.compare import HeldOutEval, _stats, eval_steps, fill_block, machine, mean_std
from composer_trl.lifecycle import EXIT_OK, UsageError, dumps

__all__ = ["RUNS", "RealRun", "run_real_comparison"]


@dataclass(frozen=True)
class RealRun:
    name: str
    kind: str  # grpo | composer | sft | trl_sdpo
    sees: str
    overrides: dict[str, Any] = field(default_factory=dict)
    feedback: bool = False


_SDPO = {"alpha_sdpo": 1.0, "beta_replay": 0.0, "sdpo_teacher": "ema", "sdpo_teacher_context": "success"}
RUNS = (
    RealRun("grpo", "grpo", "no"),
    RealRun("sdpo (success)", "composer", "no", _SDPO),
    RealRun(
        "sdpo (success + feedback)",
        "composer",
        "no (verifier feedback)",
        {**_SDPO, "sdpo_teacher_context": "success+feedback"},
        feedback=True,
    ),
    RealRun(
        "composer",
        "composer",
        "yes (replay pairs)",
        {**_SDPO, "sdpo_teacher_context": "success+feedback", "beta_replay": 1.0, "dpo_variant": "simpo"},
        feedback=True,
    ),
    RealRun("grpo+sft", "sft", "yes (SFT targets)"),
    RealRun("trl sdpo", "trl_sdpo", "no"),
)

TRL_SDPO: dict[str, Any] = {
    "distillation_weight": 0.5,  # (1 - w)·policy + w·distill: the direction of composer's policy + 1·sdpo
    "distillation_mode": "full_logits",
    "distillation_alpha": 0.5,  # composer's sdpo_beta default
    "teacher_model_kind": "ema",
    "teacher_update_rate": 0.05,
    "use_successful_as_teacher": True,
    "success_reward_threshold": 1.0,
}
"""TRL SDPOTrainer options matched to ``sdpo (success)``; its other options keep TRL's defaults."""

COMMON: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    "max_completion_length": 16,
    "learning_rate": 2e-5,
    "lr_scheduler_type": "constant",
    "beta": 0.0,
    "loss_type": "dapo",
    "temperature": 1.0,
    "bf16": False,  # one exact float32 math for every run (bench/bench_dtype.py times bf16 against it)
    "logging_steps": 1,
}
FULL = {"steps": 16, "held_out": 32, "seeds": 3}
QUICK = {
    "steps": 2,
    "held_out": 4,
    "per_device_train_batch_size": 4,
    "num_generations": 2,
    "max_completion_length": 8,
}


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# ------------------------------------------------------------------------------------------------ one cell


def _trainer(spec: dict[str, Any], run: RealRun, model: Any, tok: Any, train: list[dict[str, Any]]) -> Any:
    from composer_core.tasks.addition import addition_feedback, addition_reward
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from composer_trl.cli import run_args
    from composer_trl.compare import GRPOPlusSFTTrainer
    from composer_trl.config import ComposerGRPOConfig
    from composer_trl.trainer import ComposerGRPOTrainer

    common = {**COMMON, **spec["trainer"], **run_args(spec["work_dir"], spec["steps"], spec["seed"], True)}
    data = Dataset.from_list(train)
    kw: dict[str, Any] = {
        "model": model,
        "reward_funcs": [addition_reward],
        "train_dataset": data,
        "processing_class": tok,
    }
    if run.kind == "trl_sdpo":
        from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

        return SDPOTrainer(args=SDPOConfig(**common, **TRL_SDPO), **kw)
    if run.kind == "composer":
        extra = {"hint_fn": addition_feedback} if run.feedback else {}
        return ComposerGRPOTrainer(args=ComposerGRPOConfig(**common, **run.overrides), **kw, **extra)
    cls = GRPOPlusSFTTrainer if run.kind == "sft" else GRPOTrainer
    return cls(args=GRPOConfig(**common), **kw)


def run_cell(spec_path: str) -> int:
    """Run one (run, seed) cell described by the JSON at ``spec_path``; write its result JSON."""
    import torch
    from composer_core.tasks.addition import split_rows, verify
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(spec["threads"]))
    run = next(r for r in RUNS if r.name == spec["run"])
    trainer_kwargs = {**COMMON, **spec["trainer"]}
    need = int(trainer_kwargs["per_device_train_batch_size"]) // int(trainer_kwargs["num_generations"])
    train, held = split_rows(spec["seed"], need * (spec["steps"] + 1), spec["held_out"])
    tok = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    max_new = int(trainer_kwargs["max_completion_length"])
    evaluate = HeldOutEval([r["prompt"] for r in held], tok, eval_steps(spec["steps"]), max_new, verify)
    trainer = _trainer(spec, run, model, tok, train)
    trainer.add_callback(evaluate)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = trainer.state.log_history
    reward_key = "reward" if run.kind != "trl_sdpo" else "self_distillation/reward_mean"
    curve = [(int(r["step"]), r.get(reward_key)) for r in logs if "step" in r and reward_key in r]
    result = {
        "run": run.name,
        "seed": spec["seed"],
        "train_reward": curve,
        "held_out": evaluate.rows,
        "seconds_per_step": (wall - evaluate.seconds) / spec["steps"],
        "train_seconds": wall - evaluate.seconds,
        "eval_seconds": evaluate.seconds,
        "sdpo_loss": [
            r.get("composer/loss/sdpo", r.get("self_distillation/distillation_loss"))
            for r in logs
            if "loss" in r
        ],
    }
    tmp = Path(spec["result"]).with_suffix(".tmp")
    tmp.write_text(dumps(result, indent=1))
    tmp.replace(spec["result"])
    return EXIT_OK


# ------------------------------------------------------------------------------------------------ the table


def _spawn(spec: dict[str, Any], folder: Path) -> float:
    """Run one cell in a child process; returns its peak resident memory in MiB."""
    spec_path = folder / f"{_slug(spec['run'])}--seed{spec['seed']}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log = (folder / f"{_slug(spec['run'])}--seed{spec['seed']}.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "composer_trl.compare_real", str(spec_path)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    log.close()
    if proc.returncode != 0:
        tail = (folder / f"{_slug(spec['run'])}--seed{spec['seed']}.log").read_text()[-2000:]
        raise RuntimeError(
            f"cell {spec['run']!r} seed {spec['seed']} failed (exit {proc.returncode}):\n{tail}"
        )
    return usage.ru_maxrss / 1024.0  # Linux: KiB


def report(cells: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """``comparison.json`` from the finished cells (runs in :data:`RUNS` order; a run without cells is absent)."""
    runs: dict[str, Any] = {}
    for spec in RUNS:
        mine = sorted((c for c in cells if c["run"] == spec.name), key=lambda c: c["seed"])
        if not mine:
            continue
        final = [c["held_out"][-1] for c in mine]
        start = [c["held_out"][0] for c in mine]
        runs[spec.name] = {
            "sees_oracle_answers": spec.sees,
            "start_exact_match": _stats([f["exact_match"] for f in start]),
            "final_exact_match": _stats([f["exact_match"] for f in final]),
            "final_partial_credit": _stats([f["partial_credit"] for f in final]),
            "seconds_per_step": _stats([c["seconds_per_step"] for c in mine]),
            "peak_rss_mib": _stats([c["peak_rss_mib"] for c in mine]),
            "seeds": mine,
        }
    return {**meta, "runs": runs}


def table(rep: dict[str, Any]) -> str:
    lines = [
        f"{rep['model']}, two-digit addition, {rep['steps']} steps of {rep['trainer']['per_device_train_batch_size']} "
        f"completions ({rep['trainer']['num_generations']} per prompt, ≤ {rep['trainer']['max_completion_length']} "
        f"tokens), learning rate {rep['trainer']['learning_rate']}; greedy on {rep['held_out']} held-out sums; "
        "mean ± std over seeds (n = seeds finished).",
        "",
        "| run | sees reference answers | n | exact match at step 0 | exact match | partial credit | s / step | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rep["runs"].items():
        cells = mean_std(r, ("start_exact_match", "final_exact_match", "final_partial_credit"))
        cells += [f"{r['seconds_per_step']['mean']:.1f}", f"{r['peak_rss_mib']['mean']:.0f}"]
        lines.append(
            f"| {name} | {r['sees_oracle_answers']} | {r['final_exact_match']['n']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def run_real_comparison(inv: Any, model_dir: str) -> int:
    """Every run × seed as a child process; finished cells are kept and skipped on a rerun."""
    recipe = inv.recipe
    if recipe.dataset is not None or recipe.env is not None:
        raise UsageError(
            "--compare on a real model runs the embedded addition task; drop --dataset_name/--env."
        )
    from composer_trl.recipe import Recipe

    # --steps, else 16 (not the tiny 300)
    steps = recipe.steps if recipe.steps != Recipe.steps else FULL["steps"]
    sizes = dict(QUICK) if inv.quick else {"steps": steps, "held_out": FULL["held_out"]}
    trainer = {k: v for k, v in sizes.items() if k not in ("steps", "held_out")}
    trainer.update({k: v for k, v in recipe.trainer.items() if k in (*COMMON, "per_device_train_batch_size")})
    out = Path(recipe.output_dir)
    folder = out / "cells"
    folder.mkdir(parents=True, exist_ok=True)
    threads = int(inv.threads or os.cpu_count() or 1)
    meta = {
        "command": "composer-train --compare"
        + (" --quick" if inv.quick else "")
        + f" --seeds {inv.seeds} --model_name_or_path {recipe.model}",
        "model": str(recipe.model),
        "task": "two-digit addition (composer_core.tasks.addition)",
        "steps": sizes["steps"],
        "held_out": sizes["held_out"],
        "seeds": list(range(inv.seeds)),
        "trainer": {**COMMON, **trainer},
        "trl_sdpo_options": TRL_SDPO,
        "machine": machine(threads),
    }
    for seed in range(inv.seeds):
        for run in RUNS:
            result = folder / f"{_slug(run.name)}--seed{seed}.json"
            if result.is_file():
                print(f"[compare] {run.name} seed {seed}: finished earlier, kept")
                continue
            spec = {
                "run": run.name, "seed": seed, "model": model_dir, "steps": sizes["steps"], "held_out": sizes["held_out"],
                "trainer": trainer, "threads": threads, "result": str(result),
                "work_dir": str(out / "work" / f"{_slug(run.name)}--seed{seed}"),
            }  # fmt: skip
            print(f"[compare] {run.name} seed {seed}: training {sizes['steps']} steps ...", flush=True)
            started = time.perf_counter()
            rss = _spawn(spec, folder)
            cell = json.loads(result.read_text())
            cell["peak_rss_mib"] = rss
            result.write_text(dumps(cell, indent=1))
            print(f"[compare] {run.name} seed {seed}: done in {time.perf_counter() - started:.0f} s, "
                  f"held-out exact match {cell['held_out'][0]['exact_match']:.3f} -> {cell['held_out'][-1]['exact_match']:.3f}", flush=True)  # fmt: skip
            _write(out, meta, folder, inv.plot)
    _write(out, meta, folder, inv.plot)
    print("\n" + (out / "comparison.md").read_text())
    return EXIT_OK


def _write(out: Path, meta: dict[str, Any], folder: Path, plot: bool) -> None:
    cells = [
        json.loads(p.read_text())
        for p in sorted(folder.glob("*--seed*.json"))
        if not p.name.endswith(".spec.json")
    ]
    rep = report([c for c in cells if "peak_rss_mib" in c], meta)
    (out / "comparison.json").write_text(dumps(rep, indent=1))
    (out / "comparison.md").write_text(table(rep))
    if plot and rep["runs"]:
        from composer_trl.plot import plot_comparison

        plot_comparison(rep, out / "comparison.png", window=3)


BEGIN, END = "<!-- real-comparison:begin -->", "<!-- real-comparison:end -->"


def update_readme(readme: str | Path, comparison: str | Path) -> None:
    """Fill the README block between :data:`BEGIN` and :data:`END` from ``comparison.json`` (never typed by hand):
    ``python -m composer_trl.compare_real readme packages/composer-trl/README.md <comparison.json>``."""
    rep = json.loads(Path(comparison).read_text())
    done = {name: r["final_exact_match"]["n"] for name, r in rep["runs"].items()}
    missing = [r.name for r in RUNS if done.get(r.name, 0) < len(rep["seeds"])]
    status = (
        "every run × seed finished"
        if not missing
        else f"**partial**: {sum(done.values())} of {len(RUNS) * len(rep['seeds'])} cells finished "
        f"(unfinished: {', '.join(missing)}); rerun the command to fill the rest"
    )
    block = (
        f"Generated by `python -m composer_trl.compare_real readme` from the `comparison.json` of `{rep['command']}` "
        f"({status}; {rep['machine']}).\n\n" + table(rep)
    )
    fill_block(readme, BEGIN, END, block)


if __name__ == "__main__":
    if sys.argv[1] == "readme":
        update_readme(sys.argv[2], sys.argv[3])
    else:
        sys.exit(run_cell(sys.argv[1]))
