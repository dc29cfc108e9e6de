"""Shared builders for the bypass tests (tiny models so the suite stays fast on 2 cores).

Tests get them through the ``S`` fixture (``def test_x(S): S.teacher()``): test modules cannot import a
conftest under ``--import-mode=importlib``, and no test edits ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from composer_core.bypass import ReferenceConfig, ReferenceDecoder, config_from_dict
from composer_core.bypass.config import BypassConfig
from composer_core.bypass.data import synthetic_tokens
from safetensors.torch import load_file, save_file

VOCAB = 48


def teacher(num_layers: int = 3, seed: int = 0, **kw: Any) -> ReferenceDecoder:
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=32,
    )
    cfg.update(kw)
    return ReferenceDecoder(ReferenceConfig(**cfg)).eval()


def tokens(n: int = 24, t: int = 8, seed: int = 1) -> torch.Tensor:
    return synthetic_tokens(VOCAB, n, t, seed)


PRUNE = [{"intermediate_size": 8, "num_key_value_heads": 2}]


def config(out: Path, **sections: dict[str, Any]) -> BypassConfig:
    data: dict[str, Any] = {
        "student": {"overrides": PRUNE},
        "training": {"steps": 6, "micro_batch_size": 4, "lr": 3e-3, "warmup_steps": 1},
        "run": {"output_dir": str(out)},
    }
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return config_from_dict(data)


def final_blocks(exp: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted((exp / "final" / "blocks").glob("*.safetensors")):
        out.update({f"{f.stem}/{k}": v for k, v in load_file(str(f)).items()})
    return out


def write_tokens(path: Path, ids: torch.Tensor) -> Path:
    save_file({"input_ids": ids.contiguous()}, str(path))
    return path


@pytest.fixture(scope="session")
def S() -> SimpleNamespace:
    """The builders above: VOCAB, PRUNE, teacher, tokens, config, final_blocks, write_tokens."""
    return SimpleNamespace(
        VOCAB=VOCAB,
        PRUNE=PRUNE,
        teacher=teacher,
        tokens=tokens,
        config=config,
        final_blocks=final_blocks,
        write_tokens=write_tokens,
    )
