"""A tiny, seeded replica program (tests, benchmark, README quick start): a 3-block MLP regression with
the same initial weights on every replica and data per (seed, rank, step), run by :func:`ft_replica`
(torchft ``Manager``) or :func:`serverless_replica` (:class:`~composer_diloco.ObjectStoreManager`). Both
return plain lists and print ``sync <n> done`` after every committed sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .diloco import DiLoCoConfig
from .training import train_diloco


def toy_model(seed: int, width: int = 8) -> nn.Sequential:
    """Three blocks (strided into fragments by Streaming DiLoCo)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, width), nn.Tanh()),
        nn.Sequential(nn.Linear(width, width), nn.Tanh()),
        nn.Linear(width, 1),
    )


def toy_batches(seed: int, rank: int, batch: int = 16) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless deterministic batches for replica ``rank``: y = sin(x·w*)."""
    w_star = torch.linspace(-1, 1, 4)
    step = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + step)
        x = torch.randn(batch, 4, generator=g)
        yield x, torch.sin(x @ w_star).unsqueeze(-1)
        step += 1


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def run_toy(
    manager_factory: Any,
    *,
    rank: int,
    seed: int,
    max_syncs: int,
    diloco: dict[str, Any],
    inner: str = "adamw",
    inner_lr: float = 1e-2,
) -> dict[str, Any]:
    """Build model/optimiser, call ``manager_factory(load_fn, save_fn)``, train, return lists."""
    config = DiLoCoConfig.from_dict(diloco)
    if inner not in ("adamw", "sgd"):
        raise ValueError(f"inner optimiser must be 'adamw' or 'sgd', got {inner!r}.")
    model = toy_model(seed)
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=inner_lr, weight_decay=0.1)
        if inner == "adamw"
        else torch.optim.SGD(model.parameters(), lr=inner_lr)
    )

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    manager, cleanup = manager_factory(load, save)
    print(f"manager ready at step {manager.current_step()}", flush=True)
    participants: list[int] = []
    synced_steps: list[int] = []

    def on_step(step: int, loss: float) -> None:
        if manager.current_step() > (synced_steps[-1] if synced_steps else 0):
            synced_steps.append(manager.current_step())
            participants.append(manager.num_participants())
            print(
                f"sync {manager.current_step()} done participants={participants[-1]} loss={loss:.5f}",
                flush=True,
            )

    try:
        batches = toy_batches(seed, rank)
        stats = train_diloco(
            model, opt, manager, config, batches, _mse, max_syncs=max_syncs, progress=False, on_step=on_step
        )
    finally:
        cleanup()
    return {
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
        "step": manager.current_step(),
        "inner_steps": stats.inner_steps,
        "losses": stats.losses,
        "participants": participants,
        "synced_steps": synced_steps,
    }


def ft_replica(
    *, lighthouse_addr: str, replica_id: str, min_replica_size: int = 1, timeout_s: float = 20.0, **kw: Any
) -> dict[str, Any]:
    """Fault-tolerant replica: a real torchft Manager against the Lighthouse."""
    from .fault_tolerant import make_manager

    def factory(load: Any, save: Any) -> tuple[Any, Any]:
        group = make_manager(
            lighthouse_addr=lighthouse_addr,
            replica_id=replica_id,
            load_state_dict=load,
            state_dict=save,
            min_replica_size=min_replica_size,
            timeout_s=timeout_s,
            quorum_timeout_s=timeout_s * 3,
        )
        return group.manager, group.shutdown

    return run_toy(factory, rank=int(replica_id), **kw)


def serverless_replica(
    *,
    url: str,
    run_id: str,
    rank: int,
    world_size: int,
    timeout_s: float = 30.0,
    on_timeout: str = "fail",
    storage_options: dict[str, Any] | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """Serverless replica: torchft's DiLoCo on an ObjectStoreManager over ``url``."""
    from .object_store import ObjectStoreAllReduce
    from .serverless_manager import ObjectStoreManager

    def factory(load: Any, save: Any) -> tuple[Any, Any]:
        store = ObjectStoreAllReduce(
            url,
            run_id,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            on_timeout=on_timeout,  # type: ignore[arg-type]
            storage_options=storage_options,
        )
        manager = ObjectStoreManager(store, load, save)
        return manager, manager.shutdown

    return run_toy(factory, rank=rank, **kw)
