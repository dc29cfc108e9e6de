"""Which completion budget does SmolLM2-135M-Instruct answer two-digit addition within? Greedy base-model answers
on the task's fixed splits, cut at each budget: truncated, exact match, no stated answer.

The model answers every prompt of the validation and held-out splits (:func:`composer_core.tasks.addition.
task_splits`, the chat template a trainer applies, batched with left padding) greedily, once, up to the largest
budget; the answer at a smaller budget ``b`` is its first ``b`` tokens (greedy decoding is the same computation
up to ``b``). A reply is **truncated** at ``b`` when it has not emitted EOS within ``b`` tokens (what TRL counts
as clipped). The budget is the smallest one whose truncated fraction on the **validation** split is at most
``--max-truncated`` (10 %); the held-out numbers are printed and stored beside it, never used to choose.
``--prompt`` tries another wording (it must keep ``Compute {a} + {b}.``), again chosen on validation only; the
JSON records the wording used.

``--dtype auto`` runs bf16 autocast over float32 weights where the CPU has AVX512-BF16 or AMX (TRL's
``bf16=True``), float32 elsewhere; the JSON says which.

    python packages/composer-trl/bench/addition_budget.py [--budgets 16 32 48 64] [--dtype auto]

writes ``bench/results/addition_budget.json`` (``$COMPOSER_BENCH_OUT`` overrides the folder). ``--small``: a
tiny random model on 8 prompts per split (CI's check that the script works).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from composer_core.tasks import addition

MAX_TRUNCATED = 0.10


def _load(small: bool, tmp: Path) -> tuple[str, Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if small:
        import string

        from composer_core.tasks.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

        tok = build_char_tokenizer(string.ascii_letters + string.digits + " .,+=\n", chatml=True)
        build_tiny_model(tok, TinyModelConfig(max_position_embeddings=256), seed=0).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        name, path = "tiny-qwen2", tmp
    else:
        from composer_trl.models import packaged_model_dir

        name, path = "smollm2-135m-instruct", packaged_model_dir("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return name, tok, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(rows: list[dict[str, Any]], wording: str) -> list[list[dict[str, str]]]:
    """The rows' chat prompts in ``wording`` (a template with ``{a}`` and ``{b}``)."""
    return [[{"role": "user", "content": wording.format(a=a, b=b)}] for a, b in map(_ops, rows)]


def _ops(row: dict[str, Any]) -> tuple[int, int]:
    return addition.operands(row["prompt"])


def generate(
    model: Any, tok: Any, prompts: list[Any], max_new: int, batch: int, bf16: bool
) -> list[list[int]]:
    """Greedy token ids per prompt, cut after the first EOS (kept) or at ``max_new``."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tok.eos_token_id])
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        texts = [
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
            for p in prompts[i : i + batch]
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with torch.no_grad(), amp:
            gen = model.generate(
                **enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id
            )
        for row in gen[:, enc["input_ids"].shape[1] :].tolist():
            end = next((k for k, t in enumerate(row) if t in eos_ids), None)
            out.append(row if end is None else row[: end + 1])
        print(f"[addition_budget] {len(out)}/{len(prompts)} prompts", flush=True)
    return out


def score(
    tok: Any, prompts: list[Any], ids: list[list[int]], budget: int, eos_ids: set[int]
) -> dict[str, float]:
    """Fractions truncated (no EOS within ``budget`` tokens), exact match and no stated answer at ``budget``."""
    truncated = exact = none = 0
    for prompt, row in zip(prompts, ids, strict=True):
        cut = row[:budget]
        truncated += not (cut and cut[-1] in eos_ids)
        text = tok.decode(cut, skip_special_tokens=True)
        exact += addition.verify(prompt, text) == 1.0
        none += addition.extract_answer(text, addition.operands(prompt)) is None
    n = len(prompts)
    return {
        "budget": budget,
        "n": n,
        "truncated": truncated / n,
        "exact_match": exact / n,
        "no_answer": none / n,
    }


def _machine(threads: int, bf16: bool) -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "dtype": "bf16 autocast over float32 weights" if bf16 else "float32",
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "amx_tile": torch.cpu._is_amx_tile_supported(),
        "load_average_at_end": os.getloadavg(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--budgets", type=int, nargs="+", default=[16, 32, 48, 64], help="completion token budgets"
    )
    p.add_argument("--prompt", default=addition.PROMPT, help="the wording, with {a} and {b}")
    p.add_argument("--dtype", choices=("auto", "bf16", "float32"), default="auto")
    p.add_argument("--max-truncated", type=float, default=MAX_TRUNCATED, help="the rule's truncation bound")
    p.add_argument("--batch", type=int, default=64, help="prompts per generate call")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--small", action="store_true", help="tiny model, 8 prompts per split: CI's check")
    args = p.parse_args()
    if "Compute {a} + {b}." not in args.prompt:
        p.error("--prompt must keep 'Compute {a} + {b}.' (the verifier reads the operands from it)")
    if args.small:
        args.budgets = [4, 8]
    return args


def main() -> None:
    import tempfile

    args = _parse()
    torch.set_num_threads(args.threads)
    has_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and has_bf16)
    splits = addition.task_splits(0, 1)
    keep = 8 if args.small else None
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        name, tok, model = _load(args.small, Path(tmp))
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tok.eos_token_id])
        start = time.perf_counter()
        for split in ("validation", "held_out"):
            prompts = _prompts(getattr(splits, split)[:keep], args.prompt)
            ids = generate(model, tok, prompts, max(args.budgets), args.batch, bf16)
            results[split] = {
                "rows": [score(tok, prompts, ids, b, eos_ids) for b in sorted(args.budgets)],
                "reply_tokens": [len(r) if r[-1:] and r[-1] in eos_ids else None for r in ids],
                "replies": [tok.decode(r, skip_special_tokens=True) for r in ids],
            }
        seconds = time.perf_counter() - start
    ok = [r["budget"] for r in results["validation"]["rows"] if r["truncated"] <= args.max_truncated]
    chosen = min(ok) if ok else None
    report(name, args, bf16, results, chosen, seconds)


def report(
    name: str,
    args: argparse.Namespace,
    bf16: bool,
    results: dict[str, Any],
    chosen: int | None,
    seconds: float,
) -> None:
    rule = f"smallest budget with at most {args.max_truncated:.0%} of greedy validation replies truncated"
    data: dict[str, Any] = {
        "model": name,
        "small": args.small,
        "prompt": args.prompt,
        "prompt_is_default": args.prompt == addition.PROMPT,
        "prompt_chosen_on": "validation",
        "chat_template": "the model's own (as a trainer applies it)",
        "decoding": "greedy",
        "split_sizes": {k: len(v["replies"]) for k, v in results.items()},
        "rule": rule,
        "chosen_budget": chosen,
        "seconds": seconds,
        "splits": results,
        "machine": _machine(args.threads, bf16),
        "readme": {
            "title": f"{name}: greedy base-model replies to two-digit addition by completion budget "
            f"({'bf16 autocast' if bf16 else 'float32'})",
            "columns": ["split", "budget", "truncated", "exact match", "no stated answer"],
            "rows": [
                [
                    split,
                    r["budget"],
                    round(r["truncated"], 3),
                    round(r["exact_match"], 3),
                    round(r["no_answer"], 3),
                ]
                for split, res in results.items()
                for r in res["rows"]
            ],
            "note": f"chosen budget: {chosen} ({rule}); prompt {args.prompt!r}.",
        },
    }
    out = Path(os.environ.get("COMPOSER_BENCH_OUT", Path(__file__).parent / "results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "addition_budget.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(data["readme"]["title"])
    for row in data["readme"]["rows"]:
        print(
            f"{row[0]:<10} budget {row[1]:>3}: truncated {row[2]:.3f}  exact match {row[3]:.3f}  no answer {row[4]:.3f}"
        )
    print(
        data["readme"]["note"] if chosen is not None else f"no budget meets the rule ({rule}): try --prompt"
    )


if __name__ == "__main__":
    main()
