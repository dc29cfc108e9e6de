"""The exchange and DiLoCo with CUDA tensors (skipped without a CUDA device; CI has none, so
``scripts/cuda_checks.sh`` runs this module on a GPU machine).

A replica trains on the GPU: its parameters, pseudo-gradients and outer-optimiser state live there, and
the round must leave every tensor where it was, in place, with the value the same round gives on CPU.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch
from composer_diloco import DiLoCoConfig, ObjectStoreAllReduce, ObjectStoreManager, build_diloco
from composer_diloco.toy import toy_batches, toy_model
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
Runner = Callable[..., list[Any]]  # conftest's in_threads(fn, world)


def _state(rank: int, device: str) -> list[torch.Tensor]:
    """A state as users train it: float32 above the threaded size, bfloat16, float16, a
    non-contiguous view's base, an empty tensor. Values differ per rank (seeded)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [
        t.to(device)
        for t in (
            torch.randn(3 << 20, generator=g),
            torch.randn(257, 129, generator=g).to(torch.bfloat16),
            torch.randn(1000, generator=g).to(torch.float16),
            torch.randn(64, 48, generator=g).t().contiguous().t(),  # column-major: not contiguous
            torch.empty(0, 5),
        )
    ]


@pytest.mark.parametrize("exchange", ["full", "sharded"])
@pytest.mark.parametrize("quantize", [False, True])
def test_cuda_tensors_are_averaged_in_place_with_the_cpu_round_s_values(
    tmp_path: Path, exchange: str, quantize: bool, in_threads: Runner
) -> None:
    world = 3
    got: dict[str, list[list[torch.Tensor]]] = {}
    for device in ("cpu", "cuda"):
        values = [_state(r, device) for r in range(world)]
        ptrs = [[t.data_ptr() for t in v] for v in values]
        stores = [
            ObjectStoreAllReduce(
                f"file://{tmp_path}/{device}",
                "run",
                rank=r,
                world_size=world,
                exchange=exchange,
                timeout_s=60,
            )
            for r in range(world)
        ]
        in_threads(lambda r, s=stores, v=values: s[r].allreduce(0, v[r], quantize=quantize), world)
        for v, p in zip(values, ptrs):
            assert [t.device.type for t in v] == [device] * len(v)
            assert [t.data_ptr() for t in v] == p  # in place: the caller's tensors, not copies
        got[device] = values
    for r in range(world):
        for c, g in zip(got["cpu"][r], got["cuda"][r]):
            assert g.dtype == c.dtype and g.shape == c.shape and g.stride() == c.stride()
            assert torch.equal(g.cpu(), c)  # the average is taken on the host: bit for bit the CPU round's
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got["cuda"][0], got["cuda"][1]))


def _diloco(
    config: DiLoCoConfig, device: str, in_threads: Runner, *, world: int = 2, steps: int = 8
) -> list[list[torch.Tensor]]:
    """``world`` replicas as threads, each with torchft's DiLoCo on its own ObjectStoreManager and its
    model on ``device``; returns every replica's final parameters."""
    url = f"memory://cuda-{uuid.uuid4().hex}"
    models = [toy_model(0).to(device) for _ in range(world)]  # built in turn: toy_model seeds the global RNG
    out: list[list[torch.Tensor]] = [[] for _ in range(world)]

    def replica(rank: int) -> None:
        model = models[rank]
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        manager = ObjectStoreManager(
            ObjectStoreAllReduce(url, "run", rank=rank, world_size=world, timeout_s=60)
        )
        with build_diloco(manager, model, opt, config):
            for x, y in islice(toy_batches(0, rank), steps):
                opt.zero_grad()
                nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
                opt.step()
        assert manager.current_step() == steps // (config.sync_every // config.n_fragments)
        out[rank] = [p.detach().clone() for p in model.parameters()]

    in_threads(replica, world)
    return out


CONFIGS = {
    "nesterov": {},
    "bucketized-pinned": {"use_bucketization": True, "bucket_cap_mb": 1, "pin_memory": True},
    "backup-on-gpu": {"backup_device": "cuda"},
    "streaming-2-fragments": {"n_fragments": 2, "fragment_sync_delay": 1},
    "quantized": {"should_quantize": True},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_diloco_on_the_gpu_keeps_replicas_identical_and_matches_the_cpu_run(
    name: str, in_threads: Runner
) -> None:
    kw = dict(CONFIGS[name])
    cpu_kw = {k: v for k, v in kw.items() if k not in ("pin_memory", "backup_device")}
    gpu = _diloco(DiLoCoConfig(sync_every=4, **kw), "cuda", in_threads)
    cpu = _diloco(DiLoCoConfig(sync_every=4, **cpu_kw), "cpu", in_threads)
    assert all(p.device.type == "cuda" for p in gpu[0] + gpu[1])
    if "fragments" not in name:  # streaming: the fragment synced first has taken local steps since
        assert all(torch.equal(a, b) for a, b in zip(gpu[0], gpu[1]))  # one committed average per round
    start = [p.detach() for p in toy_model(0).parameters()]
    assert any(not torch.equal(a.cpu(), s) for a, s in zip(gpu[0], start))  # training moved the weights
    # fp8 rounds the pseudo-gradient to 3 mantissa bits: a last-ulp difference between the CPU's and the
    # GPU's matmuls can land a value on the other side of a rounding boundary
    atol = 2e-3 if name == "quantized" else 1e-5
    for g, c in zip(gpu, cpu):
        for a, b in zip(g, c):
            torch.testing.assert_close(a.cpu(), b, atol=atol, rtol=0)
