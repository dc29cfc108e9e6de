"""``composer-train --compare``: a fair, seeded comparison on the embedded digit-reversal task.

Every run gets the same seeds, optimiser steps, prompts per step, completions per prompt and completion
length (the same generation budget), and is evaluated on the same held-out prompts, which are removed
from the training set so training never sees them (greedy decoding: exact-match rate and mean partial
credit of :func:`composer_core.tasks.digit_reversal.verify`).

Runs, and which see the oracle's answers:

============  ================================================================  ===================
run           what it is                                                        sees oracle answers
============  ================================================================  ===================
grpo          plain TRL ``GRPOTrainer``: the verifier's reward only             no
grpo+sft      GRPO + 1.0 x SFT (token NLL) on the dataset's ``chosen`` answers  yes
composer      all three channels (alpha_sdpo=1, beta_replay=1)                  yes
sdpo only     channel 2 alone with GRPO (alpha_sdpo=1, beta_replay=0)           yes (via the hints)
replay only   channel 3 alone with GRPO (alpha_sdpo=0, beta_replay=1)           yes
============  ================================================================  ===================

Why GRPO + SFT is the information-matched baseline: composer's channel 3 is a preference loss whose
``chosen`` is exactly the oracle answer, and channel 2's hints are the verifier's feedback, which names the
right digit at every wrong position (a function of the oracle answer). SFT on the same ``chosen`` answers,
weighted like ``beta_replay``, added to the same GRPO loss, gives the baseline every bit of oracle
information composer gets, through the most standard channel a researcher would try first.

Writes ``comparison.json`` (every run x seed: training reward curve, held-out eval at each eval point),
``comparison.md`` (mean +- std table) and ``comparison.png`` (mean curves with min-max bands).
"""

from __future__ import annotations

import copy
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from trl import GRPOTrainer

from composer_trl.lifecycle import EXIT_OK, UsageError, dumps, prepare_output_dir


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
    RunSpec("composer", composer=True, sees_oracle="yes (hints + replay)"),
    RunSpec("sdpo only", composer=True, sees_oracle="yes (hints)", overrides={"beta_replay": 0.0}),
    RunSpec("replay only", composer=True, sees_oracle="yes (replay)", overrides={"alpha_sdpo": 0.0}),
)
SFT_WEIGHT = 1.0
"""Weight of the SFT term in ``grpo+sft`` (matches the default ``beta_replay`` of the composer run)."""
HELD_OUT = 64
"""Held-out prompts per seed (never in that seed's training set)."""
EVAL_POINTS = 4
"""Held-out evaluations during training (evenly spaced) besides step 0; the last is the final step."""
QUICK = {"steps": 4, "per_device_train_batch_size": 8, "held_out": 8}


class GRPOPlusSFTTrainer(GRPOTrainer):
    """Plain GRPO plus ``SFT_WEIGHT`` x mean token NLL of the row's ``chosen`` answer given its prompt."""

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        out = super()._generate_and_score_completions(inputs)
        tok: Any = self.processing_class
        device = out["prompt_ids"].device
        seqs, targets = [], []
        for row in inputs:
            prompt = row["prompt"]
            if not isinstance(prompt, str):  # a chat prompt: the text the policy was prompted with
                prompt = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            p = tok(prompt, add_special_tokens=False)["input_ids"]
            c = [*tok(row["chosen"], add_special_tokens=False)["input_ids"], tok.eos_token_id]
            seqs.append(p + c)
            targets.append([0] * len(p) + [1] * len(c))
        n = max(len(s) for s in seqs)
        pad = tok.pad_token_id
        out["sft_ids"] = torch.tensor([s + [pad] * (n - len(s)) for s in seqs], device=device)
        out["sft_attn"] = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs], device=device)
        out["sft_target"] = torch.tensor([t + [0] * (n - len(t)) for t in targets], device=device)
        return out

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        import torch.nn.functional as F

        loss = super().compute_loss(model, inputs, *args, **kwargs)
        ids, attn, target = inputs["sft_ids"], inputs["sft_attn"], inputs["sft_target"]
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        mask = target[:, 1:].to(nll.dtype)
        sft = (nll * mask).sum() / mask.sum().clamp_min(1.0)
        self._metrics["train"]["sft/nll"].append(float(sft.detach()))
        return loss + SFT_WEIGHT * sft


class HeldOutEval(TrainerCallback):
    """Greedy decoding on held-out prompts at step 0 and at ``steps``: exact-match rate and mean partial credit of
    ``verify(prompt, completion)`` (chat prompts go through the chat template), and the seconds it took."""

    def __init__(
        self, prompts: list[Any], tok: Any, steps: set[int], max_new_tokens: int, verify: Callable[..., float]
    ) -> None:
        self.prompts, self.tok, self.steps, self.max_new, self.verify = (
            prompts,
            tok,
            steps,
            max_new_tokens,
            verify,
        )
        self.rows: list[dict[str, float]] = []
        self.seconds = 0.0

    def evaluate(self, model: Any, step: int) -> None:
        import torch

        start = time.perf_counter()
        texts = [
            p
            if isinstance(p, str)
            else self.tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
            for p in self.prompts
        ]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        enc = {k: v.to(next(model.parameters()).device) for k, v in enc.items()}
        was_training = model.training
        model.eval()
        with torch.no_grad():
            gen = model.generate(
                **enc, max_new_tokens=self.max_new, do_sample=False, pad_token_id=self.tok.pad_token_id
            )
        if was_training:
            model.train()
        answers = self.tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        scores = [self.verify(p, t) for p, t in zip(self.prompts, answers)]
        self.rows.append(
            {
                "step": step,
                "exact_match": sum(s == 1.0 for s in scores) / len(scores),
                "partial_credit": sum(scores) / len(scores),
            }
        )
        self.seconds += time.perf_counter() - start

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
        raise UsageError(f"--compare: only {len(pool)} training rows left after removing the held-out set.")
    return pool[:n_train], held


def run_comparison(inv: Any) -> int:
    """Every run x seed; writes comparison.json / .md / .png into the output directory."""
    from composer_core.tasks.digit_reversal import verify
    from datasets import Dataset

    from composer_trl.cli import Job, load_model

    recipe = inv.recipe
    if recipe.model is not None:  # a real model: the addition task, composer_trl.compare_real
        from composer_trl.cli import model_directory
        from composer_trl.compare_real import run_real_comparison

        if inv.resume:
            raise UsageError("--compare cannot --resume_from_checkpoint; rerun it: finished cells are kept.")
        return run_real_comparison(inv, model_directory(recipe.model))
    if recipe.dataset is not None:
        raise UsageError("--compare runs on an embedded task; drop --dataset_name.")
    if inv.resume:
        raise UsageError("--compare cannot --resume_from_checkpoint; rerun it (each run takes minutes).")
    if inv.quick:
        recipe.steps = QUICK["steps"]
        recipe.trainer.setdefault("per_device_train_batch_size", QUICK["per_device_train_batch_size"])
    held_n = QUICK["held_out"] if inv.quick else HELD_OUT
    out = Path(recipe.output_dir)
    prepare_output_dir(out, overwrite=inv.overwrite, resume=False)
    results: dict[str, list[dict[str, Any]]] = {r.name: [] for r in RUNS}
    start = time.perf_counter()
    for seed in range(inv.seeds):
        for spec in RUNS:
            r = copy.deepcopy(recipe)
            r.seed = seed
            _, tok = load_model(r)
            job = Job(
                r,
                out / f"seed-{seed}",
                name=spec.name.replace(" ", "-").replace("+", "-"),
                composer=spec.composer,
                trainer_overrides=spec.overrides,
                trainer_cls=GRPOPlusSFTTrainer if spec.sft else None,
                save_model=False,
            )
            c = job.config
            need = int(c.generation_batch_size) // int(c.num_generations)
            train_rows, held = split_rows(seed, max(64, need * (r.steps + 1)), held_n)
            job.dataset, job.rewards, job.hint = Dataset.from_list(train_rows), [], None
            ev = HeldOutEval(held, tok, eval_steps(r.steps), int(c.max_completion_length), verify)
            job.callbacks.append(ev)
            res = job.run()
            if res["signal"]:
                return int(res["exit_code"])
            from composer_trl.progress import read_jsonl

            curve = [(row["step"], row.get("reward")) for row in read_jsonl(res["metrics"])]
            results[spec.name].append(
                {"seed": seed, "seconds": res["seconds"], "train_reward": curve, "held_out": ev.rows}
            )
    wall = time.perf_counter() - start
    report = _report(results, recipe, inv, held_n, wall)
    (out / "comparison.json").write_text(dumps(report, indent=2))
    (out / "comparison.md").write_text(table(report))
    print("\n" + table(report))
    if inv.plot:
        from composer_trl.plot import plot_comparison

        print(f"plot: {plot_comparison(report, out / 'comparison.png').resolve()}")
    print(f"json: {(out / 'comparison.json').resolve()}\nwall time: {wall:.0f} s")
    return EXIT_OK


def _stats(values: list[float]) -> dict[str, float]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    return {
        "mean": statistics.fmean(vals),
        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "n": len(vals),
    }


def _report(
    results: dict[str, list[dict[str, Any]]], recipe: Any, inv: Any, held_n: int, wall: float
) -> dict[str, Any]:
    import torch

    runs = {}
    for spec in RUNS:
        per_seed = results[spec.name]
        final = [s["held_out"][-1] for s in per_seed]
        last_rewards = []
        for s in per_seed:
            rs = [v for _, v in s["train_reward"] if v is not None]
            k = max(1, len(rs) // 10)
            last_rewards.append(sum(rs[-k:]) / k if rs else float("nan"))
        runs[spec.name] = {
            "sees_oracle_answers": spec.sees_oracle,
            "final_exact_match": _stats([f["exact_match"] for f in final]),
            "final_partial_credit": _stats([f["partial_credit"] for f in final]),
            "train_reward_last10pct": _stats(last_rewards),
            "seeds": per_seed,
        }
    return {
        "command": "composer-train --compare" + (" --quick" if inv.quick else "") + f" --seeds {inv.seeds}",
        "steps": recipe.steps,
        "seeds": list(range(inv.seeds)),
        "held_out_prompts": held_n,
        "trainer": recipe.trainer_kwargs(),
        "sft_weight": SFT_WEIGHT,
        "wall_seconds": wall,
        "machine": machine(torch.get_num_threads()) + f", load average {_load():.1f} at the end",
        "runs": runs,
    }


def machine(threads: int) -> str:
    return f"{platform.machine()} {os.cpu_count()} CPU cores, torch threads {threads}"


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def table(report: dict[str, Any]) -> str:
    """Markdown table: mean +- std over seeds of the final held-out metrics and the training reward."""
    n = len(report["seeds"])
    lines = [
        f"Held-out greedy evaluation after {report['steps']} steps, mean ± std over {n} seeds "
        f"({report['held_out_prompts']} held-out prompts per seed).",
        "",
        "| run | sees oracle answers | exact match | partial credit | train reward (last 10%) |",
        "|---|---|---|---|---|",
    ]
    for name, r in report["runs"].items():
        cells = mean_std(r, ("final_exact_match", "final_partial_credit", "train_reward_last10pct"))
        lines.append(f"| {name} | {r['sees_oracle_answers']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def mean_std(run: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """``mean ± std`` table cells of a run's :func:`_stats` entries ``keys``."""
    return [f"{run[k]['mean']:.3f} ± {run[k]['std']:.3f}" for k in keys]


BEGIN, END = "<!-- comparison:begin -->", "<!-- comparison:end -->"


def update_readme(readme: str | Path, comparison: str | Path) -> None:
    """Replace the README block between the comparison markers with the table of ``comparison.json``.

    ``python -m composer_trl.compare packages/composer-trl/README.md runs/composer-train/comparison.json``:
    the README's comparison numbers come from this, never from typing.
    """
    import json

    report = json.loads(Path(comparison).read_text())
    block = (
        f"Generated by `python -m composer_trl.compare` from the `comparison.json` of `{report['command']}` "
        f"(wall time {report['wall_seconds']:.0f} s on {report.get('machine', 'an unrecorded machine')}).\n\n"
        + table(report)
    )
    fill_block(readme, BEGIN, END, block)


def fill_block(readme: str | Path, begin: str, end: str, block: str) -> None:
    """Replace the text of ``readme`` between the markers ``begin`` and ``end`` with ``block``."""
    text = Path(readme).read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{readme}: no {begin} ... {end} block to fill.")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    Path(readme).write_text(f"{head}{begin}\n{block}{end}{tail}")


if __name__ == "__main__":
    import sys

    update_readme(sys.argv[1], sys.argv[2])
