"""Pipelined forwards: the teacher (capturing block inputs/outputs) and the assembled student."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from composer_core.bypass.distributed import DistContext
from composer_core.bypass.protocol import BlockwiseModel


@torch.no_grad()
def teacher_forward(
    teacher: BlockwiseModel, input_ids: Tensor, blocks: Sequence[int], ctx: DistContext
) -> tuple[dict[int, Tensor], dict[int, Tensor], Mapping[str, Any]]:
    """One no-grad teacher pass over this rank's ``blocks``: returns their inputs, outputs and the block context.

    Rank ``r > 0`` receives its first block's input from rank ``r − 1`` and sends its last
    block's output on, so each block runs on exactly one rank.
    """
    hidden, context = teacher.prepare(input_ids)
    hidden = ctx.recv_from_previous(hidden)
    inputs: dict[int, Tensor] = {}
    outputs: dict[int, Tensor] = {}
    for i in blocks:
        inputs[i] = hidden
        hidden = teacher.run_block(i, hidden, context)
        outputs[i] = hidden
    ctx.send_to_next(hidden)
    return inputs, outputs, context


@torch.no_grad()
def student_lm_loss(
    student: BlockwiseModel, input_ids: Tensor, blocks: Sequence[int], ctx: DistContext
) -> float:
    """Next-token cross-entropy of the assembled student (pipelined; every rank gets the value)."""
    _, outputs, _ = teacher_forward(student, input_ids, blocks, ctx)
    loss = float("nan")
    if ctx.rank == ctx.world_size - 1:
        logits = student.logits(outputs[blocks[-1]])[:, :-1].float()
        loss = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1)))
    return float(ctx.gather(loss)[-1])
