"""``composer-train``: train with composer's 3-channel objective inside TRL, in one command.

With no arguments it builds a tiny Qwen2 (random init, character tokenizer, no download) and trains it
on the embedded digit-reversal task (:mod:`composer_core.tasks.digit_reversal`): reward from the verifier, hints from the
verifier's feedback (channel 2), oracle answers as teacher traces (channel 3). It shows a progress bar
(reward and each channel's loss), writes ``metrics-composer.jsonl``, a PNG plot, ``summary.json`` and the
trained model, and prints where they are. ``--compare`` also trains plain TRL ``GRPOTrainer`` from the
same seed and plots both reward curves.

``--model`` (local directory or hub id) and ``--config`` (TOML/YAML recipe, see
:mod:`composer_trl.recipe`) make the same command train real models on real data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from composer_trl.recipe import Recipe, import_callable, load_recipe


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="composer-train",
        description="Train with composer's objective (GRPO + hinted self-distillation + trace replay) in TRL.",
    )
    p.add_argument(
        "--model", help="local model directory or hub id (default: a tiny Qwen2 built from config)"
    )
    p.add_argument(
        "--config", help="TOML or YAML recipe (keys: model, dataset, reward, hint_fn, steps, [trainer])"
    )
    p.add_argument("--compare", action="store_true", help="also train plain GRPO (same seed) and plot both")
    p.add_argument("--steps", type=int, help="optimiser steps (default 300)")
    p.add_argument("--seed", type=int, help="random seed (default 0)")
    p.add_argument("--output-dir", help="where metrics, plot and model go (default runs/composer-train)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    p.add_argument(
        "--threads", type=int, help="torch CPU threads (default: 1 for the tiny model, else torch's)"
    )
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from --model")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    recipe = load_recipe(args.config) if args.config else Recipe()
    for name in ("model", "steps", "seed", "output_dir"):
        value = getattr(args, name)
        if value is not None:
            setattr(recipe, name, value)
    recipe.trust_remote_code = recipe.trust_remote_code or args.trust_remote_code
    if recipe.steps < 1:
        raise SystemExit("composer-train: --steps must be >= 1")
    if not args.no_plot:
        from composer_trl.plot import _require_matplotlib

        _require_matplotlib()  # fail before training, not after

    import torch

    threads = args.threads if args.threads is not None else (1 if recipe.model is None else None)
    if threads is not None:
        torch.set_num_threads(
            threads
        )  # the tiny model runs ~10x faster on one thread than on contended cores

    out = Path(recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Path] = {}
    summary: dict[str, Any] = {
        "steps": recipe.steps,
        "seed": recipe.seed,
        "model": recipe.model or "tiny-qwen2",
    }
    runs["composer"], summary["composer"] = _train(recipe, out, composer=True)
    if args.compare:
        runs["GRPO alone"], summary["grpo"] = _train(recipe, out, composer=False)

    from composer_trl.progress import read_jsonl

    plot_path = None
    if not args.no_plot:
        from composer_trl.plot import plot_runs

        plot_path = plot_runs({k: read_jsonl(v) for k, v in runs.items()}, out / "metrics.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    print("\ncomposer-train finished")
    for label, key in (("composer", "composer"), ("GRPO alone", "grpo")):
        if key in summary:
            s = summary[key]
            print(
                f"  {label:<11} reward first 10% {s['reward_start']:.3f} -> last 10% {s['reward_end']:.3f}"
                f"  ({s['seconds']:.0f} s)"
            )
    for label, path in runs.items():
        print(f"  metrics ({label}): {path.resolve()}")
    if plot_path is not None:
        print(f"  plot:    {plot_path.resolve()}")
    print(f"  model:   {(out / 'model').resolve()}")
    print(f"  summary: {(out / 'summary.json').resolve()}")
    return 0


def _load_model(recipe: Recipe) -> tuple[Any, Any]:
    if recipe.model is None:
        from composer_core.tasks.digit_reversal import ALPHABET
        from composer_core.tasks.tiny import build_char_tokenizer, build_tiny_model

        tok: Any = build_char_tokenizer(ALPHABET)
        return build_tiny_model(tok, seed=recipe.seed), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        recipe.model, padding_side="left", trust_remote_code=recipe.trust_remote_code
    )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(recipe.model, trust_remote_code=recipe.trust_remote_code)
    return model, tok


def _load_dataset(recipe: Recipe, n_rows: int) -> Any:
    from datasets import Dataset, load_dataset

    if recipe.dataset is None:
        from composer_core.tasks.digit_reversal import make_dataset_rows

        return Dataset.from_list(make_dataset_rows(n_rows, seed=recipe.seed))
    path = Path(recipe.dataset)
    kinds = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
    if not path.is_file() or path.suffix.lower() not in kinds:
        raise ValueError(f"`dataset`={recipe.dataset!r} must be an existing .json/.jsonl/.parquet/.csv file.")
    ds = load_dataset(kinds[path.suffix.lower()], data_files=str(path), split="train")
    if "prompt" not in ds.column_names:
        raise ValueError(f"dataset {recipe.dataset!r} needs a `prompt` column; it has {ds.column_names}.")
    return ds


def _train(recipe: Recipe, out: Path, *, composer: bool) -> tuple[Path, dict[str, Any]]:
    import torch
    from composer_core.tasks.digit_reversal import reverse_hints, reverse_reward
    from transformers import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from composer_trl.config import ComposerGRPOConfig
    from composer_trl.progress import MetricsJSONL, ProgressBar, read_jsonl
    from composer_trl.trainer import ComposerGRPOTrainer

    name = "composer" if composer else "grpo"
    kwargs = recipe.trainer_kwargs()
    base_fields = {f.name for f in fields(GRPOConfig)}
    if not composer:
        kwargs = {k: v for k, v in kwargs.items() if k in base_fields}
    common = {
        "output_dir": str(out / f"trainer-{name}"),
        "max_steps": recipe.steps,
        "seed": recipe.seed,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": not torch.cuda.is_available(),
    }
    config_cls = ComposerGRPOConfig if composer else GRPOConfig
    config = config_cls(**{**common, **kwargs})
    model, tok = _load_model(recipe)
    per_step = (
        config.per_device_train_batch_size * config.gradient_accumulation_steps // config.num_generations  # type: ignore[operator]  # set by GRPOConfig.__post_init__
    )
    dataset = _load_dataset(recipe, n_rows=max(64, per_step * (recipe.steps + 1)))
    reward: Any = import_callable(recipe.reward, "reward") if recipe.reward else reverse_reward
    extra: dict[str, Any] = {}
    if composer:
        if recipe.hint_fn:
            extra["hint_fn"] = import_callable(recipe.hint_fn, "hint_fn")
        elif recipe.dataset is None:
            extra["hint_fn"] = reverse_hints
    cls = ComposerGRPOTrainer if composer else GRPOTrainer
    trainer = cls(
        model=model, reward_funcs=[reward], args=config, train_dataset=dataset, processing_class=tok, **extra
    )
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    metrics_path = out / f"metrics-{name}.jsonl"
    trainer.add_callback(ProgressBar("composer" if composer else "GRPO alone"))
    trainer.add_callback(MetricsJSONL(metrics_path))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    if composer:
        trainer.save_model(str(out / "model"))
        tok.save_pretrained(str(out / "model"))
    rows = read_jsonl(metrics_path)
    rewards = [r["reward"] for r in rows if "reward" in r]
    k = max(1, len(rewards) // 10)
    return metrics_path, {
        "seconds": seconds,
        "reward_start": sum(rewards[:k]) / k if rewards else float("nan"),
        "reward_end": sum(rewards[-k:]) / k if rewards else float("nan"),
        "metrics": str(metrics_path),
    }


def _entry() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())


if __name__ == "__main__":
    _entry()
