"""The fair comparison on the embedded digit-reversal task and the tiny Qwen2 (``nox -s demo -- --compare``).

Every run gets the same seeds, optimiser steps, prompts per step, completions per prompt and completion
length (the same generation budget), and is evaluated on the same held-out prompts, which are removed
from the training set so training never sees them (greedy decoding: exact-match rate and mean partial
credit of :func:`composer_core.tasks.digit_reversal.verify`).

============  ================================================================  ===================
run           what it is                                                        sees oracle answers
============  ================================================================  ===================
grpo          plain TRL ``GRPOTrainer``: the verifier's reward only             no
grpo+sft      GRPO + 1.0 x SFT (token NLL) on the dataset's ``chosen`` answers  yes
composer      all three channels (alpha_sdpo=1, beta_replay=1)                  yes
sdpo only     channel 2 alone with GRPO (alpha_sdpo=1, beta_replay=0)           yes (via the hints)
replay only   channel 3 alone with GRPO (alpha_sdpo=0, beta_replay=1)           yes
============  ================================================================  ===================

Each (run, seed) cell writes ``cells/<run>--seed<k>.cell.json`` when it finishes; a rerun into the same
``--output_dir`` skips finished cells. ``comparison.json`` (every run x seed: training reward curve, held-out
eval at each eval point), ``comparison.md`` (mean ± std table) and ``comparison.png`` are rebuilt from the cells.

    python packages/composer-trl/bench/compare_tiny.py [--quick] [--seeds 3] [--output_dir DIR] [--no_plot]
    python packages/composer-trl/bench/compare_tiny.py readme packages/composer-trl/README.md DIR/comparison.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _compare import (
    GRPOPlusSFTTrainer,
    fill_block,
    machine,
    mean_std,
    plot_comparison,
    read_cells,
    stats,
    write_json,
)
from composer_trl.job import Job
from transformers import TrainerCallback


@dataclass(frozen=True)
class RunSpec:
    name: str
    composer: bool
    sees_oracle: str
    overrides: dict[str, Any] = field(default_factory=dict)
    sft: bool = False


RUNS = (
    RunSpec("grpo", composer=False, sees_oracle="no"),
    RunSpec("grpo+sft", composer=False, sees_oracle="yes (SFT targets)", sft=True),
    RunSpec("composer", True, "yes (hints + replay)", {"alpha_sdpo": 1.0, "beta_replay": 1.0}),
    RunSpec("sdpo only", True, "yes (hints)", {"alpha_sdpo": 1.0, "beta_replay": 0.0}),
    RunSpec("replay only", True, "yes (replay)", {"alpha_sdpo": 0.0, "beta_replay": 1.0}),
)
HELD_OUT = 64
"""Held-out prompts per seed (never in that seed's training set)."""
EVAL_POINTS = 4
"""Held-out evaluations during training (evenly spaced) besides step 0; the last is the final step."""
STEPS = 300
QUICK = {"steps": 4, "per_device_train_batch_size": 8, "held_out": 8}


class HeldOutEval(TrainerCallback):
    """Greedy held-out evaluation at step 0 and at ``steps`` (rows of exact match and partial credit)."""

    def __init__(self, prompts: list[Any], tok: Any, steps: set[int], max_new_tokens: int) -> None:
        self.prompts, self.tok, self.steps, self.max_new = prompts, tok, steps, max_new_tokens
        self.rows: list[dict[str, float]] = []

    def evaluate(self, model: Any, step: int) -> None:
        from _compare import greedy_scores
        from composer_core.tasks.digit_reversal import verify

        r = greedy_scores(model, self.tok, self.prompts, self.max_new, verify)
        self.rows.append(
            {"step": step, "exact_match": r["exact_match"], "partial_credit": r["partial_credit"]}
        )

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if state.global_step == 0:
            self.evaluate(model, 0)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if state.global_step in self.steps:
            self.evaluate(model, state.global_step)


def eval_steps(total: int, points: int = EVAL_POINTS) -> set[int]:
    return {max(1, round(total * (i + 1) / points)) for i in range(points)}


def split_rows(seed: int, n_train: int, n_held: int) -> tuple[list[dict[str, str]], list[str]]:
    """Held-out prompts first; the training rows are drawn from the rest (disjoint by construction)."""
    from composer_core.tasks.digit_reversal import make_dataset_rows

    held = sorted({r["prompt"] for r in make_dataset_rows(n_held * 4, seed=10_000 + seed)})[:n_held]
    pool = [r for r in make_dataset_rows(n_train * 3, seed=seed) if r["prompt"] not in set(held)]
    if len(pool) < n_train:
        raise SystemExit(
            f"compare_tiny: only {len(pool)} training rows left after removing the held-out set."
        )
    return pool[:n_train], held


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


class CellJob(Job):
    """composer-train's :class:`~composer_trl.job.Job` for one cell: the given training rows (the held-out prompts
    removed), the run's own channel weights (the GRPO runs: TRL's ``GRPOConfig`` and trainer, the SFT term for
    ``grpo+sft``), the held-out evaluation as a callback, no saved model."""

    rows: list[dict[str, str]]
    evaluation: HeldOutEval

    def __init__(self, spec: RunSpec, recipe: Any, out: Path) -> None:
        self.name, self.spec = _slug(spec.name), spec
        super().__init__(recipe, out)

    def check(self) -> None:
        from datasets import Dataset

        self.dataset = Dataset.from_list(self.rows)
        trainer = {**self.recipe.trainer_kwargs(), **self.spec.overrides}
        self.config = self._config(trainer) if self.spec.composer else self.args  # args: TRL's GRPOConfig

    def make_trainer(self, model: Any, tok: Any) -> Any:
        from composer_core.tasks.digit_reversal import reverse_reward
        from trl import GRPOTrainer

        if self.spec.composer:
            trainer = super().make_trainer(model, tok)
        else:
            cls = GRPOPlusSFTTrainer if self.spec.sft else GRPOTrainer
            trainer = cls(
                model=model,
                reward_funcs=[reverse_reward],
                args=self.config,
                train_dataset=self.dataset,
                processing_class=tok,
            )
        trainer.add_callback(self.evaluation)
        return trainer

    def save(self, trainer: Any, tok: Any) -> Any:
        return None


def run_cell(spec: RunSpec, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One (run, seed): train with composer-train's job on the tiny model, evaluate, return the cell."""
    from composer_trl.cli import cpu_bf16_default
    from composer_trl.models import load_model
    from composer_trl.progress import read_jsonl
    from composer_trl.recipe import Recipe

    recipe = Recipe(steps=args.steps, seed=seed, output_dir=str(out))
    if args.quick:
        recipe.trainer["per_device_train_batch_size"] = QUICK["per_device_train_batch_size"]
    cpu_bf16_default(recipe)  # as composer-train: bf16 only where the CPU runs it natively
    _, tok = load_model(recipe)
    job = CellJob(spec, recipe, out / f"seed-{seed}")
    a = job.args
    need = int(a.generation_batch_size) // int(a.num_generations)
    job.rows, held = split_rows(seed, max(64, need * (recipe.steps + 1)), args.held_out)
    ev = job.evaluation = HeldOutEval(held, tok, eval_steps(recipe.steps), int(a.max_completion_length))
    res = job.run()
    if res["signal"]:
        raise SystemExit(int(res["exit_code"]))
    curve = [(row["step"], row.get("reward")) for row in read_jsonl(res["metrics"])]
    return {
        "run": spec.name,
        "seed": seed,
        "seconds": res["seconds"],
        "train_reward": curve,
        "held_out": ev.rows,
    }


def report(cells: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    runs = {}
    for spec in RUNS:
        per_seed = sorted((c for c in cells if c["run"] == spec.name), key=lambda c: c["seed"])
        if not per_seed:
            continue
        final = [s["held_out"][-1] for s in per_seed]
        last_rewards = []
        for s in per_seed:
            rs = [v for _, v in s["train_reward"] if v is not None]
            k = max(1, len(rs) // 10)
            last_rewards.append(sum(rs[-k:]) / k if rs else float("nan"))
        runs[spec.name] = {
            "sees_oracle_answers": spec.sees_oracle,
            "final_exact_match": stats([f["exact_match"] for f in final]),
            "final_partial_credit": stats([f["partial_credit"] for f in final]),
            "train_reward_last10pct": stats(last_rewards),
            "seeds": per_seed,
        }
    return {**meta, "runs": runs}


def table(rep: dict[str, Any]) -> str:
    """Markdown table: mean ± std over seeds of the final held-out metrics and the training reward."""
    n = len(rep["seeds"])
    lines = [
        f"Held-out greedy evaluation after {rep['steps']} steps, mean ± std over {n} seeds "
        f"({rep['held_out_prompts']} held-out prompts per seed).",
        "",
        "| run | sees oracle answers | exact match | partial credit | train reward (last 10%) |",
        "|---|---|---|---|---|",
    ]
    for name, r in rep["runs"].items():
        cells = mean_std(r, ("final_exact_match", "final_partial_credit", "train_reward_last10pct"))
        lines.append(f"| {name} | {r['sees_oracle_answers']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """Every run x seed (finished cells kept); writes comparison.json / .md / .png into ``--output_dir``."""
    import torch

    torch.set_num_threads(
        args.threads
    )  # the tiny model runs ~10x faster on one thread than on contended cores
    out = Path(args.output_dir)
    folder = out / "cells"
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for seed in range(args.seeds):
        for spec in RUNS:
            path = folder / f"{_slug(spec.name)}--seed{seed}.cell.json"
            if path.is_file():
                print(f"[compare_tiny] {spec.name} seed {seed}: finished earlier, kept", flush=True)
                continue
            cell = run_cell(spec, seed, args, out)
            write_json(path, cell)
            print(f"[compare_tiny] {spec.name} seed {seed}: held-out exact match "
                  f"{cell['held_out'][0]['exact_match']:.3f} -> {cell['held_out'][-1]['exact_match']:.3f}", flush=True)  # fmt: skip
    meta = {
        "command": "python packages/composer-trl/bench/compare_tiny.py"
        + (" --quick" if args.quick else "")
        + f" --seeds {args.seeds}",
        "steps": args.steps,
        "seeds": list(range(args.seeds)),
        "held_out_prompts": args.held_out,
        "sft_weight": 1.0,
        "wall_seconds": time.perf_counter() - start,
        "machine": machine(args.threads),
    }
    rep = report([c for c in read_cells(folder) if c["seed"] < args.seeds], meta)
    write_json(out / "comparison.json", rep)
    (out / "comparison.md").write_text(table(rep))
    print("\n" + table(rep))
    if not args.no_plot:
        print(f"plot: {plot_comparison(rep, out / 'comparison.png').resolve()}")
    print(f"json: {(out / 'comparison.json').resolve()}")
    return 0


BEGIN, END = "<!-- comparison:begin -->", "<!-- comparison:end -->"


def update_readme(readme: str | Path, comparison: str | Path) -> None:
    """Replace the README block between the comparison markers with the table of ``comparison.json``."""
    rep = json.loads(Path(comparison).read_text())
    m = rep.get("machine", "an unrecorded machine")
    if isinstance(m, dict):
        m = f"{m['cpu']}, {m['cpu_count']} cores, torch threads {m['threads']}, load average {m['load_average'][0]:.1f}"
    block = (
        f"Generated by `compare_tiny.py readme` from the `comparison.json` of `{rep['command']}` "
        f"(wall time {rep['wall_seconds']:.0f} s on {m}).\n\n" + table(rep)
    )
    fill_block(readme, BEGIN, END, block)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (default 3)")
    p.add_argument("--quick", action="store_true", help="4 steps, 8 held-out prompts (tests, smoke runs)")
    p.add_argument("--output_dir", default="runs/compare-tiny", help="cells, comparison.json/.md/.png")
    p.add_argument("--no_plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    return p


def main(argv: list[str]) -> int:
    if argv[:1] == ["readme"]:
        update_readme(argv[1], argv[2])
        return 0
    args = parser().parse_args(argv)
    if args.seeds < 1:
        parser().error(f"--seeds must be >= 1, got {args.seeds}")
    args.steps = QUICK["steps"] if args.quick else STEPS
    args.held_out = QUICK["held_out"] if args.quick else HELD_OUT
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
