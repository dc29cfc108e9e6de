"""Benchmark: ComposerGRPOTrainer vs plain TRL GRPOTrainer on the embedded task (tiny Qwen2, CPU or GPU).

1. Step time with channels off (alpha_sdpo = beta_replay = 0) vs plain GRPOTrainer — target <= 1.05x.
2. Step time with all three channels on (reported; the extra cost is the hinted teacher forward, the
   chosen/rejected forward and the reference forward).
3. Reward after K steps: composer vs GRPO alone, same seed (mean reward of the last 10% of steps).

Runs are interleaved (A, B, A, B, ...) and the median is reported, so background load hits both sides.
Prints a table and writes ``bench_trl.json`` to ``$COMPOSER_BENCH_OUT`` (default ./bench-results);
``--device cuda`` runs every trainer on the GPU (TRL's defaults, bf16 included; each timed span ends with a
``torch.cuda.synchronize()``) and writes ``bench_trl_cuda.json`` (the README's CUDA table). ``--small`` is CI's
check that the bench works: every trainer, the extras and the reward comparison, a few steps each (the JSON
records ``"small": true``).

    python packages/composer-trl/bench/bench_trl.py [--steps 30] [--repeats 3] [--reward-steps 300] [--small]
                                                    [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WARMUP_STEPS = 3
SMALL = {"steps": 2, "repeats": 1, "reward_steps": 2, "warmup_steps": 1}
"""``--small``: CI's check that the bench works (the same code paths, a few steps each)."""


def _sync(device: str) -> None:
    """Wait for the GPU's queued work, so a timed span covers it (nothing on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def _trainer(kind: str, steps: int, out: str, device: str = "cpu", seed: int = 0) -> Any:
    from composer_core.tasks.digit_reversal import ALPHABET, make_dataset_rows, reverse_hints, reverse_reward
    from composer_core.tasks.tiny import build_char_tokenizer, build_tiny_model
    from composer_trl import ComposerGRPOConfig, ComposerGRPOTrainer
    from composer_trl.recipe import TINY_TRAINER_DEFAULTS
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model(tok, seed=seed)
    data = Dataset.from_list(make_dataset_rows(8 * (steps + 2), seed=seed))
    common: dict[str, Any] = {
        "output_dir": out,
        "max_steps": steps,
        "seed": seed,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": device == "cpu",
    }
    kwargs = dict(TINY_TRAINER_DEFAULTS)
    extra: dict[str, Any] = {}
    if kind == "grpo":
        base = {f for f in GRPOConfig.__dataclass_fields__}
        config: Any = GRPOConfig(**common, **{k: v for k, v in kwargs.items() if k in base})
        cls: Any = GRPOTrainer
    else:
        if kind == "composer-off":
            kwargs.update(alpha_sdpo=0.0, beta_replay=0.0)
        else:
            kwargs = {"alpha_sdpo": 1.0, "beta_replay": 1.0, **kwargs}
            extra["hint_fn"] = reverse_hints
        config = ComposerGRPOConfig(**common, **kwargs)
        cls = ComposerGRPOTrainer
    trainer = cls(
        model=model,
        reward_funcs=[reverse_reward],
        args=config,
        train_dataset=data,
        processing_class=tok,
        **extra,
    )
    trainer.remove_callback(PrinterCallback)
    return trainer


def _step_time(kind: str, steps: int, tmp: str, device: str) -> float:
    trainer = _trainer(kind, steps, tmp, device)
    _sync(device)
    start = time.perf_counter()
    trainer.train()
    _sync(device)
    return (time.perf_counter() - start) / steps


def _extras(tmp: str, repeats: int, device: str) -> dict[str, float]:
    """The all-channels step's extra forwards measured alone, on a real micro-batch (median seconds).

    teacher_forward: the hinted teacher forward of ``_fill_sdpo`` (no grad, hinted rows only);
    pair_forward_backward: the chosen/rejected forward with its backward, as a separate forward.
    """
    tr = _trainer("composer-on", 2, tmp, device)
    captured: dict[str, Any] = {}
    original = tr._compute_loss

    def capture(model: Any, inputs: dict[str, Any]) -> Any:
        captured["inputs"] = inputs
        return original(model, inputs)

    tr._compute_loss = capture
    tr.train()
    inp, model = captured["inputs"], tr.model
    from composer_trl.teacher import base_model

    base = base_model(model)
    t = inp["completion_ids"].size(1)
    hint_rows = inp["composer_has_hint"].nonzero().squeeze(-1)
    pair_rows = inp["composer_has_pair"].nonzero().squeeze(-1)

    def teacher() -> None:
        t_ids = torch.cat([inp["composer_hint_ids"][hint_rows], inp["completion_ids"][hint_rows]], dim=1)
        t_mask = torch.cat([inp["composer_hint_mask"][hint_rows], inp["completion_mask"][hint_rows]], dim=1)
        with torch.no_grad():
            base.base_model(input_ids=t_ids, attention_mask=t_mask, use_cache=False).last_hidden_state[
                :, -t - 1 : -1
            ]

    def pairs() -> None:
        c, r = tr._pair_logps(model, inp, inp, pair_rows)
        (c.sum() + r.sum()).backward()
        model.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"teacher_forward": [], "pair_forward_backward": []}
    for _ in range(3 * repeats):
        for name, fn in (("teacher_forward", teacher), ("pair_forward_backward", pairs)):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _reward(kind: str, steps: int, tmp: str, device: str) -> dict[str, float]:
    trainer = _trainer(kind, steps, tmp, device)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    k = max(1, len(rewards) // 10)
    return {"reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimiser steps per timing run")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing runs per trainer")
    p.add_argument("--reward-steps", type=int, default=300, help="steps of the reward comparison (0 = skip)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the tiny model is fastest on 1)")
    p.add_argument("--small", action="store_true", help="a few steps each: CI's check that the bench works")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every trainer runs")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device (run without --device for the CPU bench)")
    warmup = WARMUP_STEPS
    if args.small:
        args.steps, args.repeats, args.reward_steps = SMALL["steps"], SMALL["repeats"], SMALL["reward_steps"]
        warmup = SMALL["warmup_steps"]
    torch.set_num_threads(args.threads)

    kinds = ("grpo", "composer-off", "composer-on")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        _step_time("grpo", warmup, tmp, args.device)  # warm-up (imports, allocator)
        for _ in range(args.repeats):
            for k in kinds:
                times[k].append(_step_time(k, args.steps, tmp, args.device))
        med = {k: statistics.median(v) for k, v in times.items()}
        extras = _extras(tmp, args.repeats, args.device)
        floor = med["grpo"] + sum(extras.values())
        breakdown = {
            "policy (plain GRPOTrainer step)": med["grpo"],
            "teacher forward, hinted rows (alone)": extras["teacher_forward"],
            "pair forward + backward (alone)": extras["pair_forward_backward"],
            "rest: JSD, hints, pairs, metrics (composer - floor)": med["composer-on"] - floor,
        }
        result: dict[str, Any] = {
            "device": args.device,
            "threads": args.threads,
            "steps_per_run": args.steps,
            "repeats": args.repeats,
            "small": args.small,
            "step_seconds": {k: {"median": med[k], "runs": times[k]} for k in kinds},
            "ratio_channels_off_vs_grpo": med["composer-off"] / med["grpo"],
            "ratio_channels_on_vs_grpo": med["composer-on"] / med["grpo"],
            "target_channels_off": 1.05,
            "floor_seconds": floor,
            "extras_alone_seconds": extras,
            "breakdown_seconds": breakdown,
            "ratio_channels_on_vs_floor": med["composer-on"] / floor,
            "target_channels_on_vs_floor": 1.15,
            "machine": {
                "platform": platform.platform(),
                **({"gpu": torch.cuda.get_device_name()} if args.device == "cuda" else {}),
                "cpu_count": os.cpu_count(),
                "threads": args.threads,
                "load_average_at_end": os.getloadavg(),
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            },
            "readme": {
                "title": f"ComposerGRPOTrainer step vs plain GRPOTrainer and the floor on {args.device.upper()} "
                f"({args.repeats} interleaved runs x {args.steps} steps, median)",
                "columns": ["trainer", "median s/step", "min", "max", "vs GRPO", "vs floor"],
                "rows": [
                    [
                        name,
                        round(value, 4),
                        round(min(times[k]), 4) if k else "",
                        round(max(times[k]), 4) if k else "",
                        round(value / med["grpo"], 3),
                        round(value / floor, 3),
                    ]
                    for name, k, value in (
                        ("GRPOTrainer (TRL)", "grpo", med["grpo"]),
                        ("floor: GRPO + extra forwards alone", "", floor),
                        ("ComposerGRPOTrainer, channels off", "composer-off", med["composer-off"]),
                        ("ComposerGRPOTrainer, 3 channels", "composer-on", med["composer-on"]),
                    )
                ],
            },
        }
        if args.reward_steps > 0:
            result["reward_steps"] = args.reward_steps
            result["reward"] = {
                "composer": _reward("composer-on", args.reward_steps, tmp, args.device),
                "grpo": _reward("grpo", args.reward_steps, tmp, args.device),
            }
            rc, rg = result["reward"]["composer"], result["reward"]["grpo"]
            result["readme"]["note"] = (
                f"Reward after {args.reward_steps} steps (same seed; mean of the first and last 10% of steps): "
                f"composer {rc['reward_first']:.3f} → {rc['reward_last']:.3f}, "
                f"GRPO alone {rg['reward_first']:.3f} → {rg['reward_last']:.3f}."
            )

    print(f"\ncomposer-trl benchmark (tiny Qwen2, embedded digit-reversal task, {args.device.upper()})")
    print(f"{'trainer':<34}{'median s/step':>14}{'vs GRPO':>10}")
    labels = {
        "grpo": "GRPOTrainer (TRL)",
        "composer-off": "ComposerGRPOTrainer, channels off",
        "composer-on": "ComposerGRPOTrainer, 3 channels",
    }
    for k in kinds:
        print(f"{labels[k]:<34}{med[k]:>14.4f}{med[k] / med['grpo']:>9.3f}x")
    print(f"{'floor (GRPO + extra forwards alone)':<34}{floor:>14.4f}{floor / med['grpo']:>9.3f}x")
    print("breakdown of the 3-channel step (s):")
    for name, value in breakdown.items():
        print(f"  {name:<52}{value:>8.4f}")
    print(f"3 channels / floor = {result['ratio_channels_on_vs_floor']:.3f}x (target <= 1.15x)")
    ok = result["ratio_channels_off_vs_grpo"] <= 1.05
    print(f"channels-off overhead target <= 1.05x: {'met' if ok else 'NOT met'}")
    if "reward" in result:
        rc, rg = result["reward"]["composer"], result["reward"]["grpo"]
        print(f"reward after {args.reward_steps} steps (mean of last 10%, same seed):")
        print(f"  composer   {rc['reward_first']:.3f} -> {rc['reward_last']:.3f}  ({rc['seconds']:.0f} s)")
        print(f"  GRPO alone {rg['reward_first']:.3f} -> {rg['reward_last']:.3f}  ({rg['seconds']:.0f} s)")
    out_dir = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("bench_trl.json" if args.device == "cpu" else f"bench_trl_{args.device}.json")
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path.resolve()}")


if __name__ == "__main__":
    main()
