"""Held-out validation: per-block teacher-forced loss and the assembled student's LM loss."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from composer_core.bypass.distributed import DistContext
from composer_core.bypass.forward import student_lm_loss, teacher_forward
from composer_core.bypass.protocol import BlockwiseModel


@torch.no_grad()
def validate(
    teacher: BlockwiseModel,
    student: BlockwiseModel,
    batches: Sequence[Tensor],
    blocks: Sequence[int],
    ctx: DistContext,
    loss_fn: Callable[[Tensor, Tensor, float], Tensor],
    eps: float,
) -> dict[str, object]:
    """Sequence-weighted mean over ``batches`` of each block's loss and the student LM loss.

    ``block_loss`` (mean over blocks) and ``lm_loss`` are the candidates for ``best/``.
    """
    if not batches:
        raise ValueError("validation needs at least one held-out batch (set run.val_sequences > 0)")
    was_training = student.module.training
    student.module.eval()
    sums = {i: 0.0 for i in blocks}
    lm, n = 0.0, 0
    for ids in batches:
        t_in, t_out, context = teacher_forward(teacher, ids, blocks, ctx)
        for i in blocks:
            sums[i] += float(loss_fn(student.run_block(i, t_in[i], context), t_out[i], eps)) * ids.shape[0]
        lm += student_lm_loss(student, ids, blocks, ctx) * ids.shape[0]
        n += ids.shape[0]
    student.module.train(was_training)
    merged = {b: v for part in ctx.gather({str(i): v / n for i, v in sums.items()}) for b, v in part.items()}
    per_block = dict(sorted(merged.items(), key=lambda kv: int(kv[0])))
    return {
        "block_loss": per_block,
        "mean_block_loss": sum(per_block.values()) / len(per_block),
        "lm_loss": lm / n,
    }
