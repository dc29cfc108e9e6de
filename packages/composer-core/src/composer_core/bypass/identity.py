"""Run identity: sha256 of the canonical JSON of everything that changes the result."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import Tensor, nn


def canonical_json(obj: Any) -> str:
    """Sorted keys, compact separators, no NaN: equal configs give equal bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def _update(h: Any, name: str, t: Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def tensor_fingerprint(tensor: Tensor) -> str:
    """sha256 over dtype, shape and bytes of a tensor (the training data)."""
    h = hashlib.sha256()
    _update(h, "", tensor)
    return h.hexdigest()


def module_fingerprint(module: nn.Module) -> str:
    """sha256 over every state-dict entry (name, dtype, shape, bytes) in sorted order: the teacher."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        _update(h, name, t)
    return h.hexdigest()


def run_identity(config_fields: dict[str, Any], teacher: str, data: str) -> dict[str, Any]:
    """The identity document; its :func:`sha256_json` names the experiment directory."""
    return {"config": config_fields, "teacher": teacher, "data": data, "format": 1}
