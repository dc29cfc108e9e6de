"""Run identity: sha256 of the canonical JSON of everything that changes the result."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import Tensor


def sha256_json(obj: Any) -> str:
    """sha256 of canonical JSON (sorted keys, compact, no NaN): equal configs give equal hashes."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def tensor_fingerprint(tensor: Tensor, tag: str = "|") -> str:
    """sha256 over ``tag``, dtype, shape and bytes of a tensor."""
    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{tag}{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_identity(config_fields: dict[str, Any], teacher: str, data: str) -> dict[str, Any]:
    """The identity document; its :func:`sha256_json` names the experiment directory."""
    return {"config": config_fields, "teacher": teacher, "data": data, "format": 1}
