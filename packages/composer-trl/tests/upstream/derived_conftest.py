"""conftest of a derived TRL test tree (copied there by derive.py): every test runs with the Hub stand-ins'
root as its working directory, offline."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent.parent))

import hub_standins

HUB = Path(os.environ.get("COMPOSER_HUB_STANDINS", Path(__file__).parent.parent.parent / "hub"))


@pytest.fixture(autouse=True)
def _hub_standins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(hub_standins.build(HUB))


@pytest.fixture(autouse=True)
def _bf16_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's configs default to ``bf16=True``, which transformers refuses without a GPU; TRL's CI has one. Here
    bf16 mixed precision runs as CPU autocast instead (what the configs ask for, on this machine)."""
    import torch
    import transformers.training_args as ta

    if not torch.cuda.is_available():
        monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda: True)
