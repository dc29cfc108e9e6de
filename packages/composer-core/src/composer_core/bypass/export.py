"""Write a finished run's student as a sharded safetensors checkpoint that no rank holds whole (the README's
*Export*), and read a model directory with only a rank's tensors (:func:`load_model`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from composer_core.bypass.checkpoint import read_json, save_tensors
from composer_core.bypass.distributed import DistContext, Ownership
from composer_core.bypass.hf import load_hf_model
from composer_core.bypass.protocol import BlockwiseModel
from composer_core.bypass.reference import WEIGHTS_NAME, ReferenceDecoder
from composer_core.bypass.shard import INDEX_NAME, name_owner, to_device


def export_sharded(student: BlockwiseModel, out: Path, ctx: DistContext) -> Path:
    """Every rank writes its shard of ``student``; rank 0 the config and the index (every rank calls this)."""
    out.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(getattr(student.module, "config", None), "tie_word_embeddings", False))
    mine = {
        k: v
        for k, v in student.module.state_dict().items()
        if not v.is_meta
        and name_owner(student, k, ctx.world_size) == ctx.rank
        and not (tied and k == "lm_head.weight")  # tied to the embedding: transformers re-ties it
    }
    name = (
        WEIGHTS_NAME
        if ctx.world_size == 1
        else f"model-{ctx.rank + 1:05d}-of-{ctx.world_size:05d}.safetensors"
    )
    save_tensors(mine, out / name, metadata={"format": "pt"})
    parts = ctx.gather({k: (name, v.numel() * v.element_size()) for k, v in mine.items()})
    if ctx.is_main:
        student.save_config(out)
        if ctx.world_size > 1:
            weight_map = {k: f for part in parts for k, (f, _) in part.items()}
            total = sum(size for part in parts for _, size in part.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    ctx.barrier()
    return out


def load_model(
    path: str | Path,
    ownership: Ownership | None = None,
    *,
    head: bool = True,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> BlockwiseModel:
    """Load a model directory (reference decoder or Hugging Face) with only ``ownership``'s tensors.

    The kind is read from ``config.json`` (``model_type`` → Hugging Face, extra ``hf``). A teacher
    for rank ``r`` of ``W``: ``load_model(path, Ownership.of(num_blocks, r, W), head=False)``.
    """
    p = Path(path)
    cfg = read_json(p / "config.json", "pass a model directory")
    if "model_type" in cfg:
        return load_hf_model(p, ownership=ownership, head=head, device=device, dtype=dtype)
    model = ReferenceDecoder.load(p, ownership, head=head)
    to_device(model, device)
    return model
