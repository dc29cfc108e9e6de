"""DiLoCoCallback inside a real transformers Trainer (the base of TRL's trainers)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # in the test extra: a missing install fails the session instead of skipping these tests
from composer_diloco import DiLoCoConfig, ObjectStoreAllReduce, ObjectStoreManager
from composer_diloco.trl_callback import DiLoCoCallback
from torch import nn


class TinyRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x).squeeze(-1), labels)}


def _data(n: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(n, 4, generator=g)
    return [{"x": x, "labels": torch.sin(x.sum())} for x in xs]


def _train(
    tmp_path: Path, callback: Any | None, *, max_steps: int, accumulation: int = 1
) -> list[torch.Tensor]:
    model = TinyRegressor()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / uuid.uuid4().hex),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_data(), callbacks=[callback] if callback else []
    )
    trainer.train()
    return [p.detach().clone() for p in model.parameters()]


def _manager() -> ObjectStoreManager:
    return ObjectStoreManager(
        ObjectStoreAllReduce(f"memory://trl-{uuid.uuid4().hex}", "run", rank=0, world_size=1)
    )


def test_callback_syncs_every_h_optimizer_steps(tmp_path: Path) -> None:
    manager = _manager()
    cb = DiLoCoCallback(manager, DiLoCoConfig(sync_every=2, outer_lr=0.5, outer_momentum=0.0, nesterov=False))
    trained = _train(tmp_path, cb, max_steps=6)
    assert cb.syncs == manager.current_step() == 3
    plain = _train(tmp_path, None, max_steps=6)
    assert not all(torch.allclose(a, b) for a, b in zip(trained, plain))  # the outer step changed training
    assert cb.diloco is None  # hooks removed at on_train_end


def test_gradient_accumulation_counts_optimizer_steps_not_micro_batches(tmp_path: Path) -> None:
    manager = _manager()
    cb = DiLoCoCallback(manager, DiLoCoConfig(sync_every=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False))
    _train(tmp_path, cb, max_steps=4, accumulation=2)
    assert manager.current_step() == 2  # 4 optimiser steps (8 micro-batches) / H=2


def test_one_replica_outer_lr_1_momentum_0_is_a_no_op(tmp_path: Path) -> None:
    cb = DiLoCoCallback(
        _manager(), DiLoCoConfig(sync_every=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    )
    trained = _train(tmp_path, cb, max_steps=4)
    plain = _train(tmp_path, None, max_steps=4)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(trained, plain))


def test_callback_rejects_a_non_config() -> None:
    with pytest.raises(ValueError, match="DiLoCoConfig"):
        DiLoCoCallback(_manager(), {"sync_every": 2})  # type: ignore[arg-type]
