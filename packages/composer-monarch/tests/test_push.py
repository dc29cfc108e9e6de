"""Weight push trainer → generator/teacher on a real proc mesh: exact, and never through the driver."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from composer_monarch import ComposerDriver, ComposerLoss, LoopConfig, TinyQwen2
from composer_monarch.task import ReverseDigits
from composer_monarch.weights import layout_of, pack_into, unpack_into
from torch import nn

TASK = ReverseDigits(n_digits=8, length=3)
LOSS = ComposerLoss(loss_type="grpo", alpha_sdpo=0.5, beta_replay=0.0)


@dataclass(frozen=True)
class TiedMixed:
    """Tiny Qwen2 with tied embeddings (lm_head is embed_tokens) and a bf16 layer among fp32 ones."""

    vocab_size: int

    def __call__(self) -> nn.Module:
        model = TinyQwen2(self.vocab_size, hidden_size=32, num_layers=2, intermediate_size=64)()
        model.lm_head.weight = model.model.embed_tokens.weight  # type: ignore[union-attr]
        model.model.layers[0].mlp.to(torch.bfloat16)  # type: ignore[union-attr,index,operator]
        return model


def test_layout_packs_tied_weights_once_and_round_trips_mixed_dtypes_bitwise() -> None:
    src, dst = TiedMixed(TASK.vocab_size)(), TiedMixed(TASK.vocab_size)()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))
    state = src.state_dict()
    layout = layout_of(state)
    assert {s.dtype for s in layout.slots} == {torch.float32, torch.bfloat16}
    tied = [s for s in layout.slots if s.name in ("lm_head.weight", "model.embed_tokens.weight")]
    assert len(tied) == 2 and tied[0].offset == tied[1].offset  # stored once
    distinct = sum(t.numel() * t.element_size() for t in {id(p): p for p in src.parameters()}.values())
    assert layout.nbytes < distinct + 8 * len(layout.slots)  # no second copy of the embedding
    flat = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack_into(state, layout, flat)
    unpack_into(dst, layout, flat, "test")
    for k, v in dst.state_dict().items():
        assert v.dtype == state[k].dtype and torch.equal(v, state[k]), k
    assert dst.lm_head.weight is dst.model.embed_tokens.weight  # still tied
    with pytest.raises(ValueError, match="weights do not fit"):
        unpack_into(TinyQwen2(TASK.vocab_size)(), layout, flat, "generator")


def _perturbed(state: dict[str, Any], seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model = {k: v + torch.randn(v.shape, generator=g).to(v.dtype) for k, v in state["model"].items()}
    model["lm_head.weight"] = model["model.embed_tokens.weight"]
    return {**state, "model": model}


@pytest.mark.parametrize("transport", ["shm", "rdma", "direct"])
def test_push_of_tied_mixed_dtype_model_is_bit_exact_and_the_driver_gets_a_receipt(transport: str) -> None:
    loop = LoopConfig(
        steps=1, prompts_per_step=2, group_size=2, call_timeout_s=120, weight_transport=transport
    )
    with ComposerDriver(TASK, TiedMixed(TASK.vocab_size), loss=LOSS, loop=loop) as d:
        assert d.transport == transport
        for seed in (1, 2):  # twice: the registered buffer / receive buffers are reused
            d._call("trainer", "load_state", _perturbed(d._call("trainer", "state")(), seed))()
            version = d._push_weights()
            receipt = d.last_push
            trainer = d.weights()
            for role in ("generator", "teacher"):
                v, got = d._call(role, "weights")()
                assert v == version
                assert got.keys() == trainer.keys()
                for k in trainer:
                    assert got[k].dtype == trainer[k].dtype and torch.equal(got[k], trainer[k]), (role, k)
                assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
            # what reached the driver: a receipt of a few hundred bytes, not the weights
            weight_bytes = sum(t.numel() * t.element_size() for t in trainer.values())
            assert receipt["transport"] == transport and receipt["received"] == [receipt["bytes"]] * 2
            assert len(pickle.dumps(receipt)) < 1024 and weight_bytes > 50 * 1024


def test_loop_moves_weights_and_teacher_logits_without_the_driver() -> None:
    loop = LoopConfig(steps=2, prompts_per_step=2, group_size=4, call_timeout_s=120, overlap=True)
    model = TinyQwen2(TASK.vocab_size, seed=0)
    with ComposerDriver(TASK, model, loss=LOSS, loop=loop) as d:
        seen: list[tuple[str, str, int, type]] = []
        call = d._call

        def spy(role: str, endpoint: str, *args: Any, **kw: Any) -> Callable[[], Any]:
            answer = call(role, endpoint, *args, **kw)

            def recorded() -> Any:
                out = answer()
                seen.append((role, endpoint, len(pickle.dumps(out)), type(out)))
                return out

            return recorded

        d._call = spy  # type: ignore[method-assign]
        results = d.run(progress=False)
        d._call = call  # type: ignore[method-assign]
        assert d.transport == "shm"  # auto: every receiver shares the trainer's host
        # the shared buffer's name is gone once both receivers mapped it: nothing left in /dev/shm
        assert not [f for f in os.listdir("/dev/shm") if f.startswith("composer-weights-")]
        assert all(r.metrics["composer/sdpo/tokens"] > 0 for r in results)  # channel 2 ran on the trainer
        endpoints = {(role, ep) for role, ep, _, _ in seen}
        assert ("trainer", "push_weights") in endpoints and ("teacher", "hinted_logits") in endpoints
        assert not endpoints & {
            ("trainer", "weights"),
            ("generator", "update_weights"),
            ("teacher", "update_weights"),
        }
        weight_bytes = sum(t.numel() * t.element_size() for t in d.weights().values())
        assert weight_bytes > 50 * 1024
        for role, ep, size, kind in seen:
            if ep == "push_weights":
                assert kind is dict and size < 1024, (role, ep, size)
            if ep == "hinted_logits":  # the logits' shape, not the logits
                assert kind is tuple and size < 256, (role, ep, size)
        trainer = d.weights()
        for role in ("generator", "teacher"):
            _, got = d._call(role, "weights")()
            assert all(torch.equal(got[k], trainer[k]) for k in trainer), role
