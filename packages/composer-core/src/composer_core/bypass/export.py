"""Assemble a finished run's student from its per-block checkpoint files and save it."""

from __future__ import annotations

from pathlib import Path

from composer_core.bypass.checkpoint import load_checkpoint
from composer_core.bypass.distributed import DistContext
from composer_core.bypass.protocol import BlockwiseModel


def export_student(student: BlockwiseModel, checkpoint: Path, out: Path) -> Path:
    """Load every block of ``checkpoint`` into ``student`` (built with the run's config) and ``save`` it.

    Reads the per-block files from disk, so no rank ever gathers the model over the network.
    Reference decoders are written as ``config.json`` + ``model.safetensors``; HF models with
    ``save_pretrained`` (see :mod:`composer_core.bypass.hf` for per-block shapes).
    """
    load_checkpoint(
        checkpoint, model=student, blocks=range(student.num_blocks), optimizers=None, ctx=DistContext()
    )
    student.save(out)
    return out
