"""The composer actor extension: the smallest change that gets batch fields into the policy loss.

verl 0.9's actor trains through ``TrainingWorker``, whose loss function ``partial(ppo_loss, config=actor_config)``
keeps only verl's own keys before calling the registered policy loss. Two subclasses, both using verl's own
extension points (README, "The actor extension"): :class:`ComposerTrainingWorker` wraps that loss with
:func:`composer_verl.batch.with_composer_batch`, adds the mini-batch's global SDPO-token and pair counts, holds the
``ema``/``base`` SDPO teacher's copy of its local FSDP shards (swapped into the actor around verl's ``infer_batch``,
saved with the actor checkpoint) and answers verl's logits hook for ``sdpo_form='topk'``;
:class:`ComposerActorRolloutRefWorker` uses it as the actor and adds ``compute_sdpo_teacher_log_prob``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from composer_core.sdpo import ema_update_tensors_
from torch.nn.utils.rnn import pad_sequence
from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from composer_verl.batch import (
    GLOBAL_PREF_PAIRS,
    GLOBAL_SDPO_TOKENS,
    PREF_CHOSEN,
    PREF_PAIR_ID,
    SDPO_MASK,
    SDPO_TOPK_OUTPUT,
    TEACHER_METHOD,
    TEACHER_PROMPTS,
    with_composer_batch,
)
from composer_verl.config import configure, current_config, section_of

TEACHER_SYNC_METRIC = "composer/sdpo/teacher_synced"
"""1.0 on an optimizer step after which the EMA teacher was updated, else 0.0 (logged with ema/base only)."""
TEACHER_FILE = "composer_sdpo_teacher-rank{rank}.safetensors"
"""The SDPO teacher's local shards in an actor checkpoint directory, one file per rank."""


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.values() if t.is_nested else t


def global_counts(data: Any, dp_group: Any = None) -> dict[str, float]:
    """SDPO tokens and preference pairs of a mini-batch ``TensorDict``, summed over ``dp_group``."""
    keys = data.keys()
    counts: dict[str, torch.Tensor] = {}
    if SDPO_MASK in keys:
        mask = data["response_mask"] if "response_mask" in keys else data["loss_mask"]
        sdpo = _values(data[SDPO_MASK]).bool() & _values(mask).bool()
        counts[GLOBAL_SDPO_TOKENS] = sdpo.sum().to(torch.float64)
    if PREF_PAIR_ID in keys and PREF_CHOSEN in keys:
        pairs = (data[PREF_PAIR_ID].reshape(-1) >= 0) & data[PREF_CHOSEN].reshape(-1).bool()
        counts[GLOBAL_PREF_PAIRS] = pairs.sum().to(torch.float64)
    if counts and torch.distributed.is_available() and torch.distributed.is_initialized():
        stacked = torch.stack(list(counts.values()))
        torch.distributed.all_reduce(stacked, op=torch.distributed.ReduceOp.SUM, group=dp_group)
        counts = dict(zip(counts, stacked, strict=True))
    return {k: float(v.item()) for k, v in counts.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard (FSDP2's DTensor → the tensor it holds; a plain tensor as it is)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class ComposerTrainingWorker(TrainingWorker):  # type: ignore[misc]
    """verl ``TrainingWorker`` whose loss sees composer's batch keys and which holds the ``ema``/``base`` SDPO
    teacher's weights (see module docstring)."""

    sdpo_teacher: dict[str, torch.Tensor] | None = None
    """name → detached clone of this rank's local shard of that parameter (None: the live teacher)."""
    optimizer_steps: int = 0

    def set_loss_fn(self, loss_fn: Any) -> None:
        wrapped = with_composer_batch(loss_fn, self.sdpo_topk_hook) if loss_fn is not None else None
        super().set_loss_fn(wrapped)

    def reset(self) -> None:
        super().reset()
        self.init_sdpo_teacher()

    # -- the ema/base SDPO teacher -------------------------------------------------------------------------------

    def _module(self) -> torch.nn.Module:
        module = getattr(self.engine, "module", None)
        if not isinstance(module, torch.nn.Module):
            raise ValueError(
                f"sdpo_teacher={current_config().teacher.sdpo_teacher!r} needs verl's FSDP engine, whose actor is one module "
                f"({type(self.engine).__name__} is not): set actor_rollout_ref.actor.strategy=fsdp2 or use "
                "sdpo_teacher='live'."
            )
        return module

    def init_sdpo_teacher(self) -> None:
        """Take the teacher's copy of the current (initial) weights when ``sdpo_teacher`` is ``ema``/``base``."""
        self.optimizer_steps = 0
        if current_config().teacher.sdpo_teacher == "live":
            self.sdpo_teacher = None
            return
        self.sdpo_teacher = {
            name: _local(p).detach().clone() for name, p in self._module().named_parameters()
        }

    def _teacher_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(teacher shard, actor shard) per parameter, resolved now (offloading may move the actor's)."""
        assert self.sdpo_teacher is not None
        params = dict(self._module().named_parameters())
        if params.keys() != self.sdpo_teacher.keys():
            raise ValueError(
                "the SDPO teacher's parameters no longer match the actor's (the module was rebuilt): restart the "
                "run, or resume it from a checkpoint written with the same sdpo_teacher."
            )
        return [(self.sdpo_teacher[name], _local(p)) for name, p in params.items()]

    @contextlib.contextmanager
    def teacher_weights(self) -> Iterator[None]:
        """Inside: the actor's parameters hold the teacher's values (swapped in place, swapped back after)."""
        if self.sdpo_teacher is None:
            raise ValueError(
                f"{TEACHER_METHOD} scores with the ema/base teacher, but sdpo_teacher is 'live' in this worker: "
                "build it with the Hydra config that holds the composer section (trainer_mode=composer_sync does)."
            )
        module = self._module()
        pairs = self._teacher_pairs()
        _swap(pairs, module)
        try:
            yield
        finally:
            _swap(pairs, module)

    def infer_sdpo_teacher_batch(self, data: Any) -> Any:
        """verl's ``infer_batch`` under the teacher's weights."""
        with self.teacher_weights():
            return self.infer_batch(data)

    def update_sdpo_teacher(self) -> bool:
        """Count one optimizer step; run the EMA update when ``sdpo_teacher='ema'`` syncs at it."""
        if self.sdpo_teacher is None:
            return False
        self.optimizer_steps += 1
        opts = current_config().teacher
        if not opts.syncs_at(self.optimizer_steps):
            return False
        pairs = [(t, s if s.device == t.device else s.to(t.device)) for t, s in self._teacher_pairs()]
        ema_update_tensors_(pairs, opts.teacher_update_rate)  # the teacher may sit where offloading put it
        return True

    # -- sdpo_form='topk': the live teacher's top-k, inside the training forward -------------------------------

    def sdpo_topk_hook(self, student_logits: torch.Tensor, data: Any) -> dict[str, torch.Tensor]:
        """verl's logits hook (``prepare_model_outputs`` with ``distillation_use_topk``): per token, composer_core's
        ``topk_distill`` between the student's logits and the live teacher's on the teacher context (one more
        forward of the actor's module, without gradient), on the student's top-k; one value per token (verl's
        layout: the value at position t belongs to token t + 1), 0 off the SDPO tokens."""
        from composer_core.loss.distill import topk_distill

        sdpo = current_config().compose.sdpo
        logits = student_logits.squeeze(0)  # (total_nnz, V), already divided by the temperature
        input_ids = data["input_ids"]
        offsets = input_ids.offsets().tolist()
        if logits.shape[0] != offsets[-1]:
            raise ValueError(
                "sdpo_form='topk' reads the student's logits token by token, but verl packed them "
                f"({logits.shape[0]} rows for {offsets[-1]} tokens: sequence-parallel or packing padding): set "
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 or use sdpo_form='sampled'."
            )
        tokens = input_ids.values()
        resp_lens = _response_lengths(data)
        masks = _rows(data[SDPO_MASK])
        teacher_prompts = _rows(data[TEACHER_PROMPTS])
        rows = [i for i, m in enumerate(masks) if bool(m[: int(resp_lens[i])].bool().any())]
        out = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
        if not rows:
            return {SDPO_TOPK_OUTPUT: (out + 0.0 * logits[:, 0]).unsqueeze(0)}
        ends = [offsets[i + 1] for i in rows]
        lens = [int(resp_lens[i]) for i in rows]
        pos = [torch.arange(e - r - 1, e - 1, device=logits.device) for e, r in zip(ends, lens, strict=True)]
        resp = [tokens[e - r : e] for e, r in zip(ends, lens, strict=True)]
        prompts = [teacher_prompts[i].to(tokens.device, tokens.dtype) for i in rows]
        teacher = self._teacher_response_logits(prompts, resp, data)
        student = pad_sequence([logits[p] for p in pos], batch_first=True)
        mask = pad_sequence(
            [masks[i].to(logits.device).bool()[:r] for i, r in zip(rows, lens, strict=True)], True
        )
        per_token = topk_distill(
            student,
            teacher.to(student.dtype),
            k=int(sdpo.topk or 1),
            beta=sdpo.beta,
            mask=mask,
            add_tail_bucket=sdpo.topk_tail,
            support="student",
            reduction="none",
        )
        flat_pos = torch.cat(pos)
        flat_val = torch.cat([per_token[j, :r] for j, r in enumerate(lens)])
        return {SDPO_TOPK_OUTPUT: out.index_put((flat_pos,), flat_val.to(out.dtype)).unsqueeze(0)}

    def _teacher_response_logits(
        self, prompts: list[torch.Tensor], responses: list[torch.Tensor], data: Any
    ) -> torch.Tensor:
        """(rows, max response length, V) logits of the live teacher (the actor's module, no gradient) on
        ``prompt + response`` at the response positions, divided by the rollout temperature."""
        from verl.utils import tensordict_utils as tu

        seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses, strict=True)]
        ids = pad_sequence(seqs, batch_first=True)
        attention = pad_sequence([torch.ones_like(s, dtype=torch.long) for s in seqs], batch_first=True)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = self._module()(
                input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False
            ).logits
        temperature = tu.get_non_tensor_data(data=data, key="temperature", default=1.0)
        if isinstance(temperature, torch.Tensor):
            temperature = float(temperature.reshape(-1)[0])
        picked = [
            logits[j, p.numel() - 1 : p.numel() - 1 + r.numel()]
            for j, (p, r) in enumerate(zip(prompts, responses, strict=True))
        ]
        return pad_sequence(picked, batch_first=True) / float(temperature)

    # -- verl's hooks ------------------------------------------------------------------------------------------

    def train_batch(self, data: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(data, **global_counts(data, self.engine.get_data_parallel_group()))
        cfg = current_config()
        if cfg.compose.alpha_sdpo > 0 and cfg.sdpo_form == "topk" and TEACHER_PROMPTS in data.keys():  # noqa: SIM118
            if self.engine_config.use_fused_kernels:
                raise ValueError(
                    "sdpo_form='topk' needs the student's logits, which verl's fused kernels never materialise: set "
                    "actor_rollout_ref.model.use_fused_kernels=false or use sdpo_form='sampled'."
                )
            tu.assign_non_tensor(data, distillation_use_topk=True)  # verl's engine then calls the logits hook
        out = super().train_batch(data)  # one optimizer step (verl's engine.train_batch)
        synced = self.update_sdpo_teacher()
        if self.sdpo_teacher is not None and out is not None:
            tu.get(out, "metrics")[TEACHER_SYNC_METRIC] = float(synced)
        return out

    def save_checkpoint(
        self, local_path: str, hdfs_path: Any = None, global_step: int = 0, max_ckpt_to_keep: Any = None
    ) -> Any:
        out = super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep)
        if self.sdpo_teacher is not None:
            save_teacher_shards(self.sdpo_teacher, self.optimizer_steps, local_path, _rank())
        return out

    def load_checkpoint(
        self, local_path: str, hdfs_path: Any = None, del_local_after_load: bool = False
    ) -> Any:
        if self.sdpo_teacher is not None:  # before verl may delete the local copy
            self.optimizer_steps = load_teacher_shards(self.sdpo_teacher, local_path, _rank())
        return super().load_checkpoint(local_path, hdfs_path, del_local_after_load)


def _rows(t: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a jagged (or dense) per-row tensor."""
    return list(t.unbind()) if t.is_nested else list(t)


def _response_lengths(data: Any) -> list[int]:
    """Each row's response length in a verl no-padding micro-batch (as ``no_padding_2_padding`` reads it)."""
    responses = data["responses"]
    if responses.is_nested:
        return [int(n) for n in responses.offsets().diff().tolist()]
    width = data["prompts"].shape[1]
    return [int(n) for n in data["attention_mask"][:, width:].sum(dim=1).tolist()]


@torch.no_grad()
def _swap(pairs: list[tuple[torch.Tensor, torch.Tensor]], module: torch.nn.Module) -> None:
    """Swap the values of each ``(teacher, actor)`` pair in place, then drop the unsharded parameters FSDP2 keeps
    after a forward (the root module's), so the next forward gathers the shards as they are now (verl does the
    same when it leaves eval mode with ``fsdp_size > 1``)."""
    from torch.distributed.fsdp import FSDPModule

    for t, s in pairs:
        tmp = s.clone()
        s.copy_(t)
        t.copy_(tmp)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_teacher_shards(teacher: dict[str, torch.Tensor], steps: int, directory: str, rank: int) -> str:
    """Write this rank's teacher shards (and the optimizer-step count the EMA schedule reads) to ``directory``."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TEACHER_FILE.format(rank=rank))
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in teacher.items()}
    save_file(tensors, path, metadata={"optimizer_steps": str(steps)})
    return path


def load_teacher_shards(teacher: dict[str, torch.Tensor], directory: str, rank: int) -> int:
    """Load this rank's teacher shards from ``directory`` into ``teacher`` in place; returns the step count."""
    from safetensors import safe_open

    path = os.path.join(directory, TEACHER_FILE.format(rank=rank))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: this checkpoint holds no SDPO teacher (written with sdpo_teacher='live' or before "
            "composer-verl saved it); resume with the sdpo_teacher it was trained with, or start a new run."
        )
    with safe_open(path, framework="pt") as f:
        names = set(f.keys())
        if names != set(teacher):
            raise ValueError(
                f"{path} holds other parameters than this actor ({len(names)} vs {len(teacher)}): resume with the "
                "same model and data-parallel layout, or start a new run."
            )
        with torch.no_grad():
            for name, t in teacher.items():
                t.copy_(f.get_tensor(name))
        meta = f.metadata() or {}
    return int(meta.get("optimizer_steps", 0))


class ComposerActorRolloutRefWorker(ActorRolloutRefWorker):  # type: ignore[misc]
    """verl's hybrid actor/rollout/ref worker with :class:`ComposerTrainingWorker` as the actor."""

    actor_worker_cls = ComposerTrainingWorker

    def __init__(self, config: Any, role: str, **kwargs: Any) -> None:
        configure(section_of(config))  # the composer section of the Hydra config verl hands this worker
        super().__init__(config, role, **kwargs)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))  # type: ignore[untyped-decorator]
    def compute_sdpo_teacher_log_prob(self, data: Any) -> Any:
        """verl's ``compute_log_prob`` with the ``ema``/``base`` SDPO teacher's weights (see module docstring)."""
        output = self.actor.infer_sdpo_teacher_batch(data)
        return output.cpu() if output is not None else None
