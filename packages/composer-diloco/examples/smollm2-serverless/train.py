"""Serverless DiLoCo for a Hugging Face causal LM (default: SmolLM2-135M-Instruct) over an object store.

    python train.py --store file:///tmp/diloco-store                     # 2 replicas, 3 rounds, from the hub
    python train.py --store s3://my-bucket/diloco --model /path/to/SmolLM2-135M-Instruct --replicas 4

Starts ``--replicas`` Python processes on this machine (``LocalProcessExecutor`` through ``run_serverless``). The
replicas share nothing but the store: each loads its own copy of ``--model``, fine-tunes it on its own shard of
composer_core's two-digit addition task (the prompt in the model's chat template, the loss on the reference answer
``"47 + 38 = 85"`` + end of turn) and runs torchft's DiLoCo on an ``ObjectStoreManager``: every ``--sync-every``
inner AdamW steps the replicas average their pseudo-gradients through the store and take one outer
SGD-Nesterov step. After every round each replica records a SHA-256 of its weights; the script prints one JSON line
per round (the digests, the mean inner loss) and exits non-zero unless every replica ended every round with the
same weights. See README.md next to this file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
HERE = Path(__file__).resolve().parent
TARGET = f"{Path(__file__).stem}:replica"  # this file, imported by every replica process (HERE on PYTHONPATH)


# ----------------------------------------------------------------------------------------------- replica side
def _encode(tokenizer: Any, row: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): the chat-templated prompt, then the reference answer and the end-of-turn token."""
    prompt = row["prompt"]
    if tokenizer.chat_template:
        text = str(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
    else:
        text = str(prompt[-1]["content"]) + "\n"
    prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    answer_ids = list(tokenizer(row["chosen"], add_special_tokens=False)["input_ids"])
    return prompt_ids, [*answer_ids, int(tokenizer.eos_token_id)]


def _collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int, device: Any) -> dict[str, Any]:
    """Right-padded causal-LM batch; labels only on the answer tokens (-100 on the prompt and padding)."""
    import torch

    width = max(len(p) + len(a) for p, a in examples)
    ids, mask, labels = [], [], []
    for p, a in examples:
        pad = width - len(p) - len(a)
        ids.append([*p, *a] + [pad_id] * pad)
        mask.append([1] * (len(p) + len(a)) + [0] * pad)
        labels.append([-100] * len(p) + a + [-100] * pad)
    return {
        "input_ids": torch.tensor(ids, device=device),
        "attention_mask": torch.tensor(mask, device=device),
        "labels": torch.tensor(labels, device=device),
    }


def _batches(
    examples: Sequence[tuple[list[int], list[int]]], batch_size: int, seed: int, pad_id: int, device: Any
) -> Iterator[dict[str, Any]]:
    """Endless batches over ``examples``, reshuffled every epoch (deterministic in ``seed``)."""
    import random

    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        take, order = order[:batch_size], order[batch_size:]
        yield _collate([examples[i] for i in take], pad_id, device)


def _digest(model: Any) -> str:
    """SHA-256 over every parameter's bytes, in order: equal digests = bit-identical weights."""
    import torch

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def replica(
    *,
    url: str,
    run_id: str,
    rank: int,
    world_size: int,
    storage_options: dict[str, Any] | None = None,
    model: str = MODEL,
    rounds: int = 3,
    sync_every: int = 10,
    batch_size: int = 8,
    train_rows: int = 512,
    held_out_rows: int = 32,
    lr: float = 1e-5,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int | None = None,
    seed: int = 0,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """One replica: load ``model``, train on shard ``rank`` of the addition rows with DiLoCo over ``url``."""
    import torch
    from composer_core.tasks import addition
    from composer_diloco import DiLoCoConfig, ObjectStoreAllReduce, ObjectStoreManager, train_diloco
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    if device == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(device)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    torch.manual_seed(seed)  # every replica starts from the same weights (the checkpoint's)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(dev)
    lm.train()
    train, held = addition.split_rows(seed, train_rows, held_out_rows)
    shard = [_encode(tokenizer, r) for r in train[rank::world_size]]  # each replica its own sums
    held_batch = _collate([_encode(tokenizer, r) for r in held], pad_id, dev)

    def held_out_loss() -> float:
        lm.eval()
        with torch.no_grad():
            loss = float(lm(**held_batch).loss)
        lm.train()
        return loss

    store = ObjectStoreAllReduce(
        url, run_id, rank=rank, world_size=world_size, timeout_s=timeout_s, storage_options=storage_options
    )
    manager = ObjectStoreManager(store)
    inner = torch.optim.AdamW(lm.parameters(), lr=lr, weight_decay=0.0)
    config = DiLoCoConfig(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum)
    before = held_out_loss()
    digests: list[str] = []
    round_losses: list[float] = []
    losses_since: list[float] = []
    started = time.monotonic()

    def on_step(step: int, loss: float) -> None:
        losses_since.append(loss)
        if manager.current_step() > len(digests):  # this inner step ended with a committed sync
            digests.append(_digest(lm))
            round_losses.append(sum(losses_since) / len(losses_since))
            losses_since.clear()
            print(
                f"replica {rank}: round {manager.current_step()} synced, mean inner loss {round_losses[-1]:.4f}",
                flush=True,
            )

    def loss_fn(m: Any, batch: dict[str, Any]) -> Any:
        return m(**batch).loss

    try:
        stats = train_diloco(
            lm,
            inner,
            manager,
            config,
            _batches(shard, batch_size, seed * 1_000_003 + rank, pad_id, dev),
            loss_fn,
            max_syncs=rounds,
            progress=False,
            on_step=on_step,
        )
    finally:
        manager.shutdown()
    return {
        "rank": rank,
        "digests": digests,
        "round_losses": round_losses,
        "inner_steps": stats.inner_steps,
        "held_out_loss_before": before,
        "held_out_loss_after": held_out_loss(),
        "train_rows": len(shard),
        "seconds": time.monotonic() - started,
    }


# ------------------------------------------------------------------------------------------------ driver side
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--store", required=True, help="object store URL: file:///shared/dir, s3://bucket/prefix, gs://…"
    )
    p.add_argument(
        "--storage-options", default="{}", help="fsspec storage options as JSON (e.g. an S3 endpoint)"
    )
    p.add_argument("--run-id", default=None, help="names the run under the store (default: a fresh one)")
    p.add_argument("--model", default=MODEL, help="hub id or local directory of a causal LM + tokenizer")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="outer DiLoCo rounds")
    p.add_argument("--sync-every", type=int, default=10, help="H: inner optimiser steps per round")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--train-rows", type=int, default=512, help="addition sums in the training pool (all replicas)"
    )
    p.add_argument("--held-out-rows", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5, help="inner AdamW learning rate")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda: replica r on GPU r % count"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads per replica process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds a replica waits for the others in a round"
    )
    p.add_argument(
        "--workdir", default=None, help="where the replicas' logs go (default: a temporary directory)"
    )
    p.add_argument("--keep", action="store_true", help="keep the run's objects in the store afterwards")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    from composer_diloco import LocalProcessExecutor, run_serverless

    args = parse_args(argv)
    run_id = args.run_id or f"smollm2-{uuid.uuid4().hex[:12]}"
    path = os.pathsep.join(x for x in (str(HERE), os.environ.get("PYTHONPATH", "")) if x)
    executor = LocalProcessExecutor(workdir=args.workdir, env={"PYTHONPATH": path})
    kwargs = {
        "model": args.model,
        "rounds": args.rounds,
        "sync_every": args.sync_every,
        "batch_size": args.batch_size,
        "train_rows": args.train_rows,
        "held_out_rows": args.held_out_rows,
        "lr": args.lr,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "seed": args.seed,
        "timeout_s": args.timeout,
    }
    print(
        f"run {run_id}: {args.replicas} replicas of {args.model} over {args.store}",
        file=sys.stderr,
        flush=True,
    )
    results = run_serverless(
        executor,
        TARGET,
        url=args.store,
        run_id=run_id,
        world_size=args.replicas,
        kwargs=kwargs,
        storage_options=json.loads(args.storage_options),
        cleanup=not args.keep,
    )
    values = [r.value for r in results]
    rows = []
    for i in range(args.rounds):
        digests = [v["digests"][i] if i < len(v["digests"]) else None for v in values]
        row = {
            "round": i + 1,
            "identical": None not in digests and len(set(digests)) == 1,
            "digests": digests,
            "mean_inner_loss": [v["round_losses"][i] if i < len(v["round_losses"]) else None for v in values],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    summary = {
        "replicas": args.replicas,
        "rounds": args.rounds,
        "identical_every_round": all(r["identical"] for r in rows),
        "held_out_loss_before": values[0]["held_out_loss_before"],
        "held_out_loss_after": [v["held_out_loss_after"] for v in values],
        "seconds": [round(r.seconds, 1) for r in results],
    }
    print(json.dumps(summary), flush=True)
    if not summary["identical_every_round"]:
        raise SystemExit("replicas ended a round with different weights")
    print(
        f"the {args.replicas} replicas ended each of the {args.rounds} rounds with identical weights",
        flush=True,
    )
    return rows


if __name__ == "__main__":
    main()
