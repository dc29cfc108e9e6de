"""The trainer: the policy model, its optimiser and the composer loss; one optimiser step per batch.

:class:`PolicyTrainer` is plain Python (usable in-process); :class:`TrainerActor` hosts one on a
Monarch proc mesh. Both run the same code, so a step on the mesh equals the step in-process bit for
bit on CPU (tested).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from composer_core.loss.metrics import ADAPTER_PREFIX
from monarch.actor import endpoint
from torch import Tensor, nn

from composer_monarch import weights as wt
from composer_monarch.forge_loss import ComposerLoss
from composer_monarch.model import forward_logits, token_logprobs
from composer_monarch.policy_copy import ProcessActor, state_copy
from composer_monarch.rollout import TrainBatch

ModelFactory = Callable[[], nn.Module]


@dataclass(frozen=True)
class TrainerConfig:
    """Optimiser (AdamW) and numerics of the trainer.

    ``num_threads`` sets ``torch.set_num_threads`` in the process that builds the trainer (None: leave
    it); equal thread counts are what makes a mesh step bit-identical to the in-process step.
    ``max_grad_norm`` None turns clipping off.
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr}: must be > 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm}: must be > 0 or None")


def collate(batch: TrainBatch, pad_id: int) -> tuple[Tensor, dict[str, Tensor]]:
    """TorchForge-style ``(tokens, targets)`` for :class:`ComposerLoss` from a :class:`TrainBatch`.

    Rows: the B sampled completions, then the P chosen and P rejected pair completions (all after
    their prompt; prompts must share one length). Responses are right-padded to one width.
    """
    b, p = batch.prompt_ids.shape
    responses, masks, prompts = [batch.completion_ids], [batch.completion_mask.bool()], [batch.prompt_ids]
    pairs, n = batch.pairs, 0 if batch.pairs is None else len(batch.pairs)
    if pairs is not None and n:
        if pairs.prompt_ids.shape[1] != p:
            raise ValueError(
                f"pair prompts have length {pairs.prompt_ids.shape[1]}, sampled prompts {p}: the trainer "
                "packs pairs and samples into one forward pass and needs one prompt length"
            )
        responses += [pairs.chosen_ids, pairs.rejected_ids]
        masks += [pairs.chosen_mask.bool(), pairs.rejected_mask.bool()]
        prompts += [pairs.prompt_ids, pairs.prompt_ids]
    width = max(r.shape[1] for r in responses)

    def widen(t: Tensor, fill: float | int | bool) -> Tensor:
        if t.shape[1] == width:
            return t
        pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill, dtype=t.dtype)
        return torch.cat([t, pad], dim=1)

    response = torch.cat([widen(r, pad_id) for r in responses])
    mask = torch.cat([widen(m, False) for m in masks])
    tokens = torch.cat([torch.cat(prompts), response], dim=1)

    def rows_of(t: Tensor) -> Tensor:  # the sampled rows' values, zeros on the 2n pair rows
        t = t.float() if t.dim() == 1 else widen(t.float(), 0.0)
        return torch.cat([t, t.new_zeros((2 * n, *t.shape[1:]))])

    targets: dict[str, Tensor] = {
        "response": response,
        "padding_mask": mask,
        "advantages": rows_of(batch.advantages).unsqueeze(-1),
        "old_logprobs": rows_of(batch.inference_logprobs),
        "policy_rows": torch.arange(b + 2 * n) < b,
    }
    if batch.teacher_logits is not None:
        targets["teacher_logits"] = rows_of(batch.teacher_logits)
        distilled = targets["policy_rows"]
        if batch.sdpo_rows is not None:  # completions without a hint are not distilled
            distilled = rows_of(batch.sdpo_rows).bool()
        targets["sdpo_mask"] = mask & distilled.unsqueeze(-1)
    if n:
        targets["chosen_rows"] = torch.arange(b, b + n)
        targets["rejected_rows"] = torch.arange(b + n, b + 2 * n)
    return tokens, targets


class PolicyTrainer:
    """Policy model + AdamW + :class:`ComposerLoss`; ``train_step`` does one optimiser step.

    When the loss needs reference log-probs (KL penalty, DPO), a frozen copy of the initial policy
    is the reference model.
    """

    def __init__(
        self, model_fn: ModelFactory, loss: ComposerLoss, config: TrainerConfig, *, pad_id: int
    ) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.loss = loss
        self.pad_id = pad_id
        self.model = model_fn().train()
        self.reference = (
            copy.deepcopy(self.model).eval().requires_grad_(False) if loss.needs_reference else None
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.version = 0

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step; returns the metrics to log: composer-core's ``compose_loss`` keys under
        ``composer/`` (``composer/loss/total``, ``composer/sdpo/tokens``, ...) and this adapter's own
        ``composer/train/grad_norm`` (when clipping), ``composer/reward/mean``, ``composer/policy/staleness``."""
        tokens, targets = collate(batch, self.pad_id)
        if self.reference is not None:
            with torch.no_grad():
                response = targets["response"]
                ref_logits = forward_logits(self.reference, tokens)[:, -response.shape[1] - 1 : -1]
                targets["ref_logprobs"] = token_logprobs(ref_logits, response, self.loss.temperature)
        logits = forward_logits(self.model, tokens)
        loss = self.loss(logits, **targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped
        metrics = {ADAPTER_PREFIX + k: v for k, v in self.loss.last_result.metrics.items()}
        if self.config.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            metrics[ADAPTER_PREFIX + "train/grad_norm"] = float(norm)
        self.optimizer.step()
        self.version += 1
        metrics[ADAPTER_PREFIX + "reward/mean"] = float(batch.rewards.float().mean())
        metrics[ADAPTER_PREFIX + "policy/staleness"] = float(self.version - 1 - batch.policy_version)
        return metrics

    def weights(self) -> dict[str, Tensor]:
        """A detached copy of the policy's state dict."""
        return state_copy(self.model)

    def state(self) -> dict[str, Any]:
        """Everything a step depends on: version, model, optimiser (a copy)."""
        state = {"version": self.version, "model": self.model.state_dict()}
        return copy.deepcopy({**state, "optimizer": self.optimizer.state_dict()})

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` (e.g. to replay a step in-process, or resume)."""
        if missing := {"version", "model", "optimizer"} - set(state):
            raise ValueError(f"trainer state lacks {sorted(missing)}: pass PolicyTrainer.state()'s result")
        self.model.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])


class TrainerActor(ProcessActor):
    """A :class:`PolicyTrainer` on a Monarch proc mesh (TorchForge's ``TitanTrainer`` role).

    After :meth:`connect` it holds the generator and teacher actors: :meth:`push_weights` sends them the
    weights itself (packed, over RDMA or one direct message; see :mod:`composer_monarch.weights`) and
    ``train_step`` takes the teacher's hinted logits from the teacher (``TrainBatch.teacher_key``).
    """

    def __init__(
        self, model_fn: ModelFactory, loss: ComposerLoss, config: TrainerConfig, pad_id: int
    ) -> None:
        self.trainer = PolicyTrainer(model_fn, loss, config, pad_id=pad_id)
        self.peers: dict[str, Any] = {}
        self.transport = "direct"
        self.timeout_s = 300.0
        self._layout: wt.WeightLayout | None = None
        self._flat: Tensor | None = None
        self._rdma: Any = None
        self._shm: tuple[str, Tensor] | None = None

    @endpoint
    def connect(self, peers: dict[str, Any], transport: str, timeout_s: float) -> str:
        """Hold the receivers (role → actor mesh) and pick the transport; returns the one in use."""
        self.peers = dict(peers)
        hosts = [p.host.call_one().get(timeout=timeout_s) for p in self.peers.values()]
        self.transport = wt.resolve_transport(transport, same_host=all(h == wt.host_id() for h in hosts))
        self.timeout_s = float(timeout_s)
        return self.transport

    def _packed(self) -> tuple[wt.WeightLayout, Tensor]:
        """The weights packed into the transport's send buffer (made at its first push, then rewritten in place)."""
        state = self.trainer.model.state_dict()
        if self._layout is None:
            self._layout = wt.layout_of(state)
        if self.transport == "shm":
            self._shm = self._shm or wt.shared_buffer(self._layout.nbytes)
            flat = self._shm[1]
        else:
            if self._flat is None:
                self._flat = torch.empty(self._layout.nbytes, dtype=torch.uint8)
            flat = self._flat
        if self.transport == "rdma" and self._rdma is None:
            import warnings

            from monarch.rdma import RDMABuffer

            with warnings.catch_warnings():  # the TCP transport warns once per process; we report it
                warnings.simplefilter("ignore")
                self._rdma = RDMABuffer(flat)
        wt.pack_into(state, self._layout, flat)
        return self._layout, flat

    def _futures(self, version: int, layout: wt.WeightLayout, flat: Tensor) -> list[Any]:
        peers = self.peers.values()
        if self.transport == "shm":
            assert self._shm is not None
            return [p.map_weights.call_one(version, layout, self._shm[0]) for p in peers]
        if self.transport == "rdma":
            return [p.pull_weights.call_one(version, layout, self._rdma, self.timeout_s) for p in peers]
        return [p.load_weights.call_one(version, layout, flat) for p in peers]

    @endpoint
    def push_weights(self) -> dict[str, Any]:
        """Send the current weights to every connected receiver; returns a receipt (no weights)."""
        if not self.peers:
            raise RuntimeError("TrainerActor.push_weights: connect(peers, ...) first")
        t0 = time.perf_counter()
        layout, flat = self._packed()
        version = self.trainer.version
        futs = self._futures(version, layout, flat)
        received = [int(f.get(timeout=self.timeout_s)) for f in futs]
        if self.transport == "shm" and self._shm and os.path.exists(self._shm[0]):
            os.unlink(self._shm[0])  # every receiver has mapped it: drop its name (the mappings stay valid)
        return {
            "version": version,
            "bytes": layout.nbytes,
            "received": received,
            "transport": self.transport,
            "seconds": time.perf_counter() - t0,
        }

    def _with_teacher_logits(self, batch: TrainBatch) -> TrainBatch:
        if batch.teacher_logits is not None or batch.teacher_key is None:
            return batch
        teacher = self.peers.get("teacher")
        if teacher is None:
            raise RuntimeError("the batch's teacher logits live on the teacher: connect the teacher first")
        logits = teacher.take_logits.call_one(batch.teacher_key).get(timeout=self.timeout_s)
        return replace(batch, teacher_logits=logits)

    @endpoint
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.trainer.train_step(self._with_teacher_logits(batch))

    @endpoint
    def weights(self) -> tuple[int, dict[str, Tensor]]:
        """(version, state dict): a copy for the user (``ComposerDriver.weights``); pushes do not use it."""
        return self.trainer.version, self.trainer.weights()

    @endpoint
    def version(self) -> int:
        """Optimiser steps taken so far."""
        return self.trainer.version

    @endpoint
    def state(self) -> dict[str, Any]:
        return self.trainer.state()

    @endpoint
    def load_state(self, state: dict[str, Any]) -> None:
        self.trainer.load_state(state)
