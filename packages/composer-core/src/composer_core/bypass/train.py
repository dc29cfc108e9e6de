"""The bypass training loop (blockwise local distillation, Puzzle arXiv 2411.19146; the README's "Bypass engine").

Per micro-batch, one no-grad teacher forward captures every block's input and output; each student block runs
on the *teacher's* input and is trained towards the teacher's output (its own AdamW and GradScaler).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm  # type: ignore[import-untyped, unused-ignore]

from composer_core.bypass.checkpoint import (
    MANIFEST,
    find_resume_checkpoint,
    is_complete,
    load_checkpoint,
    prune_checkpoints,
    read_json,
    save_checkpoint,
    set_aside_checkpoints,
    set_aside_corrupt,
    step_name,
    verify_files,
    write_json_atomic,
)
from composer_core.bypass.config import BypassConfig, StudentConfig, TrainingConfig
from composer_core.bypass.data import TokenBatches
from composer_core.bypass.distributed import DistContext, Ownership
from composer_core.bypass.forward import teacher_forward
from composer_core.bypass.identity import run_identity, sha256_json, tensor_fingerprint
from composer_core.bypass.keys import check_keys_for_model, freeze_for_training
from composer_core.bypass.losses import get_loss
from composer_core.bypass.optim import BlockOptimizer, cosine_lr, make_block_optimizer, optimizer_step
from composer_core.bypass.protocol import BlockwiseModel
from composer_core.bypass.shard import sharded_fingerprint, source_of, to_device
from composer_core.bypass.student import build_student
from composer_core.bypass.validation import validate


@dataclass
class BypassResult:
    """Outcome of one run. ``student`` holds this rank's trained blocks (all blocks in one process)."""

    run_id: str
    experiment_dir: Path
    skipped: bool
    student: BlockwiseModel
    history: list[dict[str, Any]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)
    batches_consumed: int = 0

    def final_block_loss(self) -> dict[str, float]:
        """Per-block training loss of the last step."""
        return dict(self.history[-1]["block_loss"]) if self.history else {}


def experiment_dir(config: BypassConfig, run_id: str) -> Path:
    return Path(config.run.output_dir) / f"{config.run.name}-{run_id[:16]}"


def _decide(exp: Path, run_id: str, identity: dict[str, Any], resume: bool) -> dict[str, Any]:
    """Rank 0: skip (complete run with this identity), resume (newest intact checkpoint) or start fresh.

    Skipping writes nothing (a finished run can be re-run from a read-only disk).
    """
    manifest_path = exp / MANIFEST
    if manifest_path.is_file():
        manifest = read_json(manifest_path, "move it away to start this run afresh")
        if manifest.get("run_id") != run_id:
            raise ValueError(
                f"{exp} belongs to run {manifest.get('run_id')!r}, not {run_id!r}; choose another run.output_dir/name"
            )
        if resume and manifest.get("status") == "completed" and is_complete(exp / "final"):
            problem = verify_files(exp / "final")
            if problem is None:
                return {"action": "skip", "path": str(exp / "final")}
            set_aside_corrupt(exp, exp / "final", problem)
    exp.mkdir(parents=True, exist_ok=True)
    if not resume:
        set_aside_checkpoints(exp, "superseded by a run started with resume=False")
    path = find_resume_checkpoint(exp) if resume else None
    write_json_atomic(manifest_path, {"run_id": run_id, "identity": identity, "status": "running"})
    return {"action": "resume" if path else "fresh", "path": str(path) if path else None}


def _initial_state(
    decision: dict[str, Any],
    student: BlockwiseModel,
    owned: list[int],
    optimizers: Any,
    ctx: DistContext,
    grad_accum: int,
) -> dict[str, Any]:
    """A fresh run's state, or the state of the checkpoint ``decision`` says to resume from."""
    if decision["action"] != "resume":
        return {"step": 0, "batches_consumed": 0, "history": [], "validation": [], "best": None}
    path = Path(decision["path"])
    state: dict[str, Any] = ctx.run_everywhere(
        lambda: load_checkpoint(path, model=student, blocks=owned, optimizers=optimizers, ctx=ctx)
    )
    if state["batches_consumed"] != state["step"] * grad_accum:
        raise ValueError(f"checkpoint {path}: batches_consumed does not match step × grad_accum")
    return state


def _flush(
    pending: list[tuple[int, float, dict[int, float]]], state: dict[str, Any], ctx: DistContext
) -> None:
    """Merge every rank's per-block losses of the steps since the last flush into the history."""
    parts = ctx.gather([(step, lr, {str(i): v for i, v in losses.items()}) for step, lr, losses in pending])
    for k, (step, lr, _) in enumerate(pending):
        merged = {b: v for part in parts for b, v in part[k][2].items()}
        block_loss = dict(sorted(merged.items(), key=lambda kv: int(kv[0])))
        state["history"].append({"step": step, "lr": lr, "block_loss": block_loss})
    pending.clear()


def _check_inputs(
    teacher: BlockwiseModel, input_ids: Tensor, owned: Sequence[int], ctx: DistContext, config: BypassConfig
) -> TokenBatches:
    for i in owned:
        if any(p.is_meta for p in teacher.block(i).parameters()):
            raise ValueError(
                f"rank {ctx.rank} owns teacher block {i} but it is not materialised: load the teacher with "
                f"ownership=DistContext.current().ownership(num_blocks)"
            )
    tcfg = config.training
    data = TokenBatches(
        input_ids,
        micro_batch_size=tcfg.micro_batch_size,
        seed=tcfg.seed,
        val_sequences=config.run.val_sequences,
    )
    if input_ids.numel() and int(input_ids.max()) >= teacher.vocab_size:
        raise ValueError(
            f"input_ids contains token id {int(input_ids.max())} but the teacher's vocabulary has "
            f"{teacher.vocab_size} entries: tokenize with the teacher's tokenizer"
        )
    return data


def run_bypass(
    teacher: BlockwiseModel,
    input_ids: Tensor,
    config: BypassConfig,
    *,
    resume: bool = True,
    progress: bool = True,
    hold_all_blocks: bool = False,
) -> BypassResult:
    """Build the student from ``teacher`` and train it blockwise on ``input_ids`` ``[N, T]``.

    Runs in one process or, when ``torch.distributed`` is initialised, with blocks split across
    ranks (every rank calls this with the same arguments). ``teacher`` needs only this rank's
    blocks materialised (:func:`composer_core.bypass.load_model` with this rank's ``Ownership``);
    the student holds only its owned parts unless ``hold_all_blocks``. Resumes from the newest
    intact checkpoint unless ``resume=False``; a completed run with the same identity is skipped.
    """
    ctx = DistContext.current()
    tcfg, rcfg = config.training, config.run
    ownership = ctx.ownership(teacher.num_blocks)
    owned = list(ownership.blocks)
    data = _check_inputs(teacher, input_ids, owned, ctx, config)
    teacher.module.eval().requires_grad_(False)
    to_device(teacher.module, ctx.device)
    identity = run_identity(
        config.identity_fields(),
        sharded_fingerprint(teacher, source_of(teacher), ctx),
        tensor_fingerprint(input_ids),
    )
    run_id = sha256_json(identity)
    exp = experiment_dir(config, run_id)
    decision = ctx.run_on_main(lambda: _decide(exp, run_id, identity, resume))

    torch.manual_seed(tcfg.seed)
    student = make_student(teacher, config.student, data, None if hold_all_blocks else ownership, ctx)
    to_device(student.module, ctx.device)
    check_keys_for_model(student, tcfg.keys_to_learn)
    loss_fn = get_loss(tcfg.loss)
    if decision["action"] == "skip":
        done = load_checkpoint(Path(decision["path"]), model=student, blocks=owned, optimizers=None, ctx=ctx)
        history, val = done.get("history", []), done.get("validation", [])
        return BypassResult(run_id, exp, True, student, history, val, int(done["batches_consumed"]))

    optimizers = make_optimizers(student, owned, tcfg, ctx.device.type)
    state = _initial_state(decision, student, owned, optimizers, ctx, tcfg.grad_accum)

    pending: list[tuple[int, float, dict[int, float]]] = []

    def save(name: str, latest: bool = True) -> None:
        _flush(pending, state, ctx)
        save_checkpoint(
            exp,
            name,
            model=student,
            blocks=owned,
            optimizers=optimizers,
            state=state,
            ctx=ctx,
            update_latest=latest,
        )

    student.module.train()
    quiet = not (progress and ctx.is_main)
    bar = tqdm(total=tcfg.steps, initial=state["step"], disable=quiet, desc="bypass", unit="step")
    tokens_per_step = tcfg.grad_accum * tcfg.micro_batch_size * data.train.shape[1]
    while state["step"] < tcfg.steps:
        t0 = time.perf_counter()
        micro = [data.batch(state["batches_consumed"] + k).to(ctx.device) for k in range(tcfg.grad_accum)]
        lr = cosine_lr(
            state["step"],
            lr=tcfg.lr,
            min_lr=tcfg.min_lr,
            warmup_steps=tcfg.warmup_steps,
            total_steps=tcfg.steps,
        )
        losses = bypass_step(teacher, student, optimizers, owned, micro, ctx, tcfg, lr)
        state["batches_consumed"] += tcfg.grad_accum
        state["step"] += 1
        pending.append((state["step"], lr, losses))
        mean = sum(losses.values()) / len(losses)  # this rank's blocks
        bar.set_postfix(loss=f"{mean:.4g}", tok_s=f"{tokens_per_step / (time.perf_counter() - t0):.0f}")
        bar.update(1)
        if rcfg.val_every and (state["step"] % rcfg.val_every == 0 or state["step"] == tcfg.steps):
            _flush(pending, state, ctx)
            val = [b.to(ctx.device) for b in data.val_batches()]
            result = validate(teacher, student, val, owned, ctx, loss_fn, tcfg.loss_eps)
            state["validation"].append({"step": state["step"], **result})
            metric = float(result["lm_loss" if rcfg.best_metric == "lm_loss" else "mean_block_loss"])  # type: ignore[arg-type]
            if state["best"] is None or metric < state["best"]["value"]:
                state["best"] = {"step": state["step"], "value": metric}
                save("best", latest=False)
        if rcfg.save_every and state["step"] % rcfg.save_every == 0 and state["step"] < tcfg.steps:
            save(step_name(state["step"]))
            if ctx.is_main and rcfg.keep_last:
                prune_checkpoints(exp, rcfg.keep_last)
    bar.close()
    save("final")
    if ctx.is_main:
        manifest = read_json(exp / MANIFEST, "move it away to start this run afresh")
        write_json_atomic(exp / MANIFEST, {**manifest, "status": "completed", "final": "final"})
        if rcfg.keep_last:
            prune_checkpoints(exp, rcfg.keep_last)
    ctx.barrier()
    return BypassResult(
        run_id, exp, False, student, state["history"], state["validation"], state["batches_consumed"]
    )


def make_optimizers(
    student: BlockwiseModel, blocks: Sequence[int], tcfg: TrainingConfig, device: str = "cpu"
) -> dict[int, BlockOptimizer]:
    """Freeze the student except ``keys_to_learn`` of ``blocks``; one AdamW + GradScaler per trainable block."""
    params = freeze_for_training(student, blocks, tcfg.keys_to_learn)
    opts = {k: getattr(tcfg, k) for k in ("lr", "betas", "eps", "weight_decay", "loss_scaling", "init_scale")}
    return {i: make_block_optimizer(i, ps, device=device, **opts) for i, ps in params.items() if ps}


def bypass_step(
    teacher: BlockwiseModel,
    student: BlockwiseModel,
    optimizers: dict[int, BlockOptimizer],
    blocks: Sequence[int],
    micro_batches: Sequence[Tensor],
    ctx: DistContext,
    tcfg: TrainingConfig,
    lr: float,
) -> dict[int, float]:
    """One optimiser step over ``micro_batches`` (gradient accumulation); returns each block's mean loss.

    Per micro-batch: one no-grad teacher forward, then every block of ``blocks`` on the
    teacher's input; ``loss / len(micro_batches)`` is scaled and back-propagated (block
    inputs carry no grad, so backward stops at each block). Blocks without an optimizer
    (nothing trainable) are only evaluated.
    """
    loss_fn = get_loss(tcfg.loss)
    n = len(micro_batches)
    losses = {i: 0.0 for i in blocks}
    for ids in micro_batches:
        t_in, t_out, context = teacher_forward(teacher, ids, blocks, ctx)
        for i in blocks:
            with torch.set_grad_enabled(i in optimizers):
                loss = loss_fn(student.run_block(i, t_in[i], context), t_out[i], tcfg.loss_eps)
            if i in optimizers:
                scaled: Tensor = optimizers[i].scaler.scale(loss / n)
                torch.autograd.backward(scaled)
            losses[i] += float(loss.detach()) / n
    for opt in optimizers.values():
        optimizer_step(opt, lr=lr, clip=tcfg.clip, clip_value=tcfg.clip_value)
    return losses


def make_student(
    teacher: BlockwiseModel,
    student: StudentConfig,
    data: TokenBatches,
    ownership: Ownership | None = None,
    ctx: DistContext | None = None,
) -> BlockwiseModel:
    """Build and initialise the student (importance scores from the first training batches).

    With ``ownership`` only its blocks get storage (every rank of ``ctx`` calls this).
    """
    device = (ctx or DistContext()).device
    calibration = None
    if student.mlp_init_mode == "importance":
        calibration = [data.batch(i).to(device) for i in range(student.importance_batches)]
    modes: dict[str, Any] = {"mlp_init_mode": student.mlp_init_mode, "gqa_init_mode": student.gqa_init_mode}
    return build_student(
        teacher, student.overrides, **modes, calibration=calibration, ownership=ownership, ctx=ctx
    )


def run_sweep(
    teacher: BlockwiseModel,
    input_ids: Tensor,
    config: BypassConfig,
    students: Sequence[StudentConfig],
    *,
    resume: bool = True,
    progress: bool = True,
) -> list[BypassResult]:
    """One run per student configuration (each has its own identity and directory)."""
    if not students:
        raise ValueError("a sweep needs at least one student configuration")
    return [
        run_bypass(teacher, input_ids, config.with_student(s), resume=resume, progress=progress)
        for s in students
    ]
