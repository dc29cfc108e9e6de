"""A real verl policy-update step through the composer actor extension, on CPU.

What is real: verl 0.9.1's ``TrainingWorker`` (our ``ComposerTrainingWorker`` subclass), its FSDP2 engine
(``FSDPEngineWithLMHead``) wrapping a tiny Qwen2 model (``composer_core.tasks.tiny``), verl's ``ppo_loss`` worker loss, the registered
``composer`` policy loss, verl's DataProto -> TensorDict -> no-padding conversion, mini-batch iterator,
micro-batching, backward and optimizer step, on a 1-rank gloo process group.

What is bridged, and why: verl 0.9 has no CPU platform. Its platform registry knows nvidia/huawei/amd
only and falls back to CUDA (``get_device_name() == "cuda"``, NCCL backend), and its FSDP engine is
registered for ``device=["cuda", "npu"]``. The test therefore (1) installs the test kit's CPU
``PlatformBase`` (``verl_cpu_testkit.platform``, the one the ``main_ppo`` end-to-end run registers) through
verl's own ``set_platform`` (device "cpu", backend gloo, no-op memory stats),
(2) selects the FSDP engine class with verl's own ``VERL_ENGINE_DEVICE=cuda`` override, and (3) uses
``attn_implementation="sdpa"`` with ``use_remove_padding=False`` (verl defaults to flash-attention 2,
which needs a GPU) and fp32 mixed precision. No verl code is patched. Ray is not started: the worker
object is built in-process, as a Ray actor would build it.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import torch
from verl_cpu_testkit.platform import cpu_platform

LN2 = math.log(2.0)
B, P, R = 4, 5, 6


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import torch.distributed as dist
    from composer_core.tasks.tiny import TinyModelConfig, build_tiny_qwen2
    from composer_verl.actor import ComposerTrainingWorker
    from verl.plugin.platform import platform_manager, set_platform
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.config.engine import TrainingWorkerConfig

    previous_platform = platform_manager._current_platform
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "VERL_ENGINE_DEVICE")
    saved_env = {k: os.environ.get(k) for k in names}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        VERL_ENGINE_DEVICE="cuda",
    )
    set_platform(cpu_platform())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    path = tmp_path_factory.mktemp("tiny-qwen2")
    build_tiny_qwen2(128, TinyModelConfig(hidden_size=32, intermediate_size=64), seed=0).save_pretrained(path)
    model = HFModelConfig(
        path=str(path),
        load_tokenizer=False,
        use_remove_padding=False,
        enable_gradient_checkpointing=False,
        override_config={"attn_implementation": "sdpa"},
    )
    engine = FSDPEngineConfig(
        strategy="fsdp2",
        use_torch_compile=False,
        model_dtype="fp32",
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        infer_micro_batch_size_per_gpu=2,
    )
    w = ComposerTrainingWorker(
        config=TrainingWorkerConfig(
            model_type="language_model",
            model_config=model,
            engine_config=engine,
            optimizer_config=FSDPOptimizerConfig(lr=1e-2),
            checkpoint_config=None,
        )
    )
    w.reset()
    try:
        yield w
    finally:
        dist.destroy_process_group()
        set_platform(previous_platform) if previous_platform is not None else None
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _actor_config(loss_mode: str) -> Any:
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=2,
        ppo_mini_batch_size=B,
        ppo_micro_batch_size_per_gpu=2,
        use_torch_compile=False,
        policy_loss={"loss_mode": loss_mode},
    )


def _batch(extra: dict[str, torch.Tensor], compute_loss: bool = True) -> Any:
    """A rollout-shaped batch (left-padded prompt, right-padded response), converted as verl's trainer does."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 128, (B, P), generator=g)
    responses = torch.randint(1, 128, (B, R), generator=g)
    attention = torch.ones(B, P + R, dtype=torch.long)
    attention[0, :2] = 0
    attention[1, -2:] = 0
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention,
        "position_ids": torch.clamp(torch.cumsum(attention, 1) - 1, min=0),
        "response_mask": attention[:, P:].clone(),
        **extra,
    }
    td = left_right_2_no_padding(DataProto.from_dict(tensors=tensors).to_tensordict())
    tu.assign_non_tensor(
        td,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=B,
        mini_batch_size=B,
        epochs=1,
        seed=0,
        dataloader_kwargs={"shuffle": False},
        compute_loss=compute_loss,
        temperature=1.0,
        multi_turn=False,
    )
    return td


def _old_log_probs(worker: Any) -> tuple[torch.Tensor, torch.Tensor]:
    from verl.workers.utils.padding import no_padding_2_padding

    data = _batch({}, compute_loss=False)
    out = worker.infer_batch(data)
    old = no_padding_2_padding(out["log_probs"], _batch({}, compute_loss=False)).detach()
    mask = _batch({})["response_mask"]
    return old, mask


def _metrics(out: Any) -> dict[str, float]:
    """verl's metrics, reduced the way its trainer reduces them (Metric aggregation or list mean)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import Metric

    reduced = {}
    for key, value in tu.get(out, "metrics").items():
        if isinstance(value, Metric):
            reduced[key] = value.aggregate()
        elif isinstance(value, list) and value and isinstance(value[0], Metric):
            reduced[key] = Metric.aggregate_dp(value)
        elif isinstance(value, list):
            reduced[key] = sum(float(v) for v in value) / len(value)
        else:
            reduced[key] = float(value)
    return reduced


def test_composer_equals_vanilla_in_the_engine(worker: Any) -> None:
    from verl.workers.utils.losses import ppo_loss

    old, mask = _old_log_probs(worker)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask
    extra = {"old_log_probs": old - 0.3 * mask, "advantages": adv}  # ratio e^0.3: clipping is active
    losses = {}
    for mode in ("vanilla", "composer"):
        worker.set_loss_fn(partial(ppo_loss, config=_actor_config(mode)))
        losses[mode] = _metrics(worker.infer_batch(_batch(extra)))["actor/pg_loss"]
    assert losses["composer"] == pytest.approx(losses["vanilla"], rel=1e-6, abs=1e-7)
    assert losses["vanilla"] != 0.0


def test_policy_update_step_with_sdpo_and_replay_keys(worker: Any) -> None:
    """Composer keys travel DataProto -> mini-batch -> micro-batch -> loss, normalised by global counts."""
    from composer_verl.config import configure
    from verl.workers.utils.losses import ppo_loss

    configure({"alpha_sdpo": 0.5, "beta_replay": 0.25})
    old, mask = _old_log_probs(worker)
    sdpo_mask = torch.ones(B, R)
    sdpo_mask[3] = 0  # a row without a hint
    extra = {
        "old_log_probs": old,
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask,
        "composer_teacher_log_probs": old - LN2,  # teacher gives each sampled token half the probability
        "composer_sdpo_mask": sdpo_mask,
        # rows (0, 1) and (2, 3) are pairs; reference = the current policy, so DPO = ln 2 per pair
        "composer_pref_pair_id": torch.tensor([0, 0, 1, 1]),
        "composer_pref_chosen": torch.tensor([1, 0, 0, 1]),
        "composer_pref_ref_log_prob": (old * mask).sum(-1),
    }
    worker.set_loss_fn(partial(ppo_loss, config=_actor_config("composer")))
    before = [p.detach().clone() for p in worker.engine.module.parameters()]
    m = _metrics(worker.train_mini_batch(_batch(extra)))
    # two micro-batches of 2 rows: 10 and 6 SDPO tokens out of 16; each contributes Σd/16, and verl
    # averages the per-micro-batch metric: (10 + 6)/16·ln 2 / 2.
    assert m["composer/sdpo/tokens"] == pytest.approx((10 + 6) / 2)
    assert m["composer/loss/sdpo"] == pytest.approx(LN2 / 2, rel=1e-5)
    # one pair per micro-batch, 2 pairs in the mini-batch: each contributes ln 2 / 2; verl averages
    assert m["composer/replay/pairs"] == 1.0
    assert m["composer/loss/replay"] == pytest.approx(LN2 / 2, rel=1e-5)
    after = list(worker.engine.module.parameters())
    changed = sum(not torch.equal(a.detach(), b) for a, b in zip(after, before))
    assert changed == len(before)


def test_plain_verl_worker_loss_cannot_see_the_keys(worker: Any) -> None:
    """Without the extension's wrapper verl's ppo_loss drops composer keys: the loss says so."""
    from composer_verl.config import configure
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    configure({"alpha_sdpo": 0.5})
    old, mask = _old_log_probs(worker)
    extra = {
        "old_log_probs": old,
        "advantages": mask.double(),
        "composer_teacher_log_probs": old,
        "composer_sdpo_mask": mask,
    }
    TrainingWorker.set_loss_fn(
        worker, partial(ppo_loss, config=_actor_config("composer"))
    )  # bypass the wrapper
    with pytest.raises(ValueError, match="actor extension"):
        worker.infer_batch(_batch(extra))


def test_actor_rollout_ref_worker_uses_the_extension() -> None:
    from composer_verl.actor import ComposerActorRolloutRefWorker, ComposerTrainingWorker
    from verl.workers.engine_workers import ActorRolloutRefWorker

    assert issubclass(ComposerActorRolloutRefWorker, ActorRolloutRefWorker)
    assert ComposerActorRolloutRefWorker.actor_worker_cls is ComposerTrainingWorker
    assert ComposerActorRolloutRefWorker.ref_worker_cls is ActorRolloutRefWorker.ref_worker_cls


# --- the ema/base SDPO teacher held by the actor worker -------------------------------------------------------------


def _log_probs(worker: Any, teacher: bool = False) -> torch.Tensor:
    from verl.workers.utils.padding import no_padding_2_padding

    data = _batch({}, compute_loss=False)
    out = worker.infer_sdpo_teacher_batch(data) if teacher else worker.infer_batch(data)
    return no_padding_2_padding(out["log_probs"], _batch({}, compute_loss=False)).detach()


def _local_params(worker: Any) -> dict[str, torch.Tensor]:
    from composer_verl.actor import _local

    return {n: _local(p).detach().clone() for n, p in worker.engine.module.named_parameters()}


def _holder(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Plain module with these tensors as parameters (for composer_core's module-level ema_update_)."""
    m = torch.nn.Module()
    for name, t in tensors.items():
        m.register_parameter(name.replace(".", "__"), torch.nn.Parameter(t.clone()))
    return m


def _train_step(worker: Any) -> dict[str, float]:
    from verl.workers.utils.losses import ppo_loss

    old, mask = _old_log_probs(worker)
    extra = {
        "old_log_probs": old,
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask,
        "composer_teacher_log_probs": old - LN2,
        "composer_sdpo_mask": mask.float(),
    }
    worker.set_loss_fn(partial(ppo_loss, config=_actor_config("composer")))
    return _metrics(worker.train_mini_batch(_batch(extra)))  # 4 rows, mini-batch 4: one optimizer step


@pytest.fixture
def teacher_worker(worker: Any) -> Iterator[Any]:
    yield worker
    worker.sdpo_teacher = None  # the module-scoped worker goes back to the live teacher
    worker.optimizer_steps = 0


def test_base_teacher_scores_with_the_initial_weights(teacher_worker: Any) -> None:
    """After an optimizer step the base teacher's log-probs are bit-equal to the weights it was taken from, and
    scoring with it leaves the actor's own log-probs bit-unchanged (the swap and FSDP's reshard are exact)."""
    from composer_verl.config import configure

    w = teacher_worker
    configure({"alpha_sdpo": 0.5, "sdpo_teacher": "base", "env": "digit-reversal"})
    w.init_sdpo_teacher()
    initial = _log_probs(w)
    assert torch.equal(_log_probs(w, teacher=True), initial)
    _train_step(w)
    student = _log_probs(w)
    assert not torch.equal(student, initial)  # the actor moved
    assert torch.equal(_log_probs(w, teacher=True), initial)  # the teacher did not
    assert torch.equal(_log_probs(w), student)  # and the actor is back
    assert w.optimizer_steps == 1


def test_ema_teacher_update_equals_core_ema_update(teacher_worker: Any) -> None:
    """θT ← (1 − τ)θT + τθS after each optimizer step, bit-equal to composer_core.sdpo.ema_update_ on modules;
    with teacher_sync_steps=2 only every second step."""
    from composer_core.sdpo import ema_update_
    from composer_verl.config import configure

    w = teacher_worker
    configure(
        {
            "alpha_sdpo": 0.5,
            "sdpo_teacher": "ema",
            "teacher_update_rate": 0.25,
            "teacher_sync_steps": 2,
            "env": "e",
        }
    )
    w.init_sdpo_teacher()
    theta0 = _local_params(w)
    assert all(torch.equal(w.sdpo_teacher[n], t) for n, t in theta0.items())
    assert _train_step(w)["composer/sdpo/teacher_synced"] == 0.0  # step 1: no sync
    assert all(torch.equal(w.sdpo_teacher[n], t) for n, t in theta0.items())
    assert _train_step(w)["composer/sdpo/teacher_synced"] == 1.0  # step 2: sync
    theta2 = _local_params(w)
    expected = _holder(theta0)
    ema_update_(expected, _holder(theta2), 0.25)
    got = dict(expected.named_parameters())
    assert all(torch.equal(w.sdpo_teacher[n], got[n.replace(".", "__")]) for n in theta0)
    assert any(not torch.equal(w.sdpo_teacher[n], theta0[n]) for n in theta0)
    # the teacher's log-probs differ from the actor's, and scoring with it restores the actor exactly
    student = _log_probs(w)
    assert not torch.equal(_log_probs(w, teacher=True), student)
    assert torch.equal(_log_probs(w), student)


def test_teacher_shards_save_and_load(teacher_worker: Any, tmp_path: Any) -> None:
    from composer_verl.actor import TEACHER_FILE, load_teacher_shards, save_teacher_shards
    from composer_verl.config import configure

    w = teacher_worker
    configure({"alpha_sdpo": 0.5, "sdpo_teacher": "ema", "env": "digit-reversal"})
    w.init_sdpo_teacher()
    saved = {n: t.clone() for n, t in w.sdpo_teacher.items()}
    path = save_teacher_shards(w.sdpo_teacher, 7, str(tmp_path), 0)
    assert path.endswith(TEACHER_FILE.format(rank=0))
    for t in w.sdpo_teacher.values():
        t.zero_()
    assert load_teacher_shards(w.sdpo_teacher, str(tmp_path), 0) == 7
    assert all(torch.equal(w.sdpo_teacher[n], t) for n, t in saved.items())
    with pytest.raises(FileNotFoundError, match="holds no SDPO teacher"):
        w.load_checkpoint(str(tmp_path / "elsewhere"))  # raises before verl's own load


def test_live_worker_refuses_teacher_scoring(worker: Any) -> None:
    assert worker.sdpo_teacher is None
    with pytest.raises(ValueError, match="sdpo_teacher is 'live'"):
        worker.infer_sdpo_teacher_batch(_batch({}, compute_loss=False))


def test_teacher_method_is_dispatched_like_compute_log_prob() -> None:
    from composer_verl.actor import ComposerActorRolloutRefWorker
    from composer_verl.batch import TEACHER_METHOD
    from verl.single_controller.base.decorator import MAGIC_ATTR

    ours = getattr(getattr(ComposerActorRolloutRefWorker, TEACHER_METHOD), MAGIC_ATTR)
    verls = getattr(ComposerActorRolloutRefWorker.compute_log_prob, MAGIC_ATTR)
    assert (
        ours["dispatch_mode"]["dispatch_fn"].args == verls["dispatch_mode"]["dispatch_fn"].args == ("actor",)
    )
    assert ours["dispatch_mode"]["dispatch_fn"].func is verls["dispatch_mode"]["dispatch_fn"].func


def test_teacher_is_saved_and_loaded_with_verls_actor_checkpoint(teacher_worker: Any, tmp_path: Any) -> None:
    """verl's own checkpoint manager writes the actor; the teacher's shards and step count go next to it, and a
    load brings back actor, teacher and EMA schedule: the same log-probs on both sides, bit for bit."""
    from composer_verl.actor import TEACHER_FILE
    from composer_verl.config import configure

    w = teacher_worker
    configure({"alpha_sdpo": 0.5, "sdpo_teacher": "ema", "teacher_update_rate": 0.5, "env": "e"})
    w.init_sdpo_teacher()
    _train_step(w)
    teacher = {n: t.clone() for n, t in w.sdpo_teacher.items()}
    student_lp, teacher_lp = _log_probs(w), _log_probs(w, teacher=True)
    w.save_checkpoint(str(tmp_path / "actor"), global_step=1)
    assert TEACHER_FILE.format(rank=0) in os.listdir(tmp_path / "actor")
    _train_step(w)  # actor and teacher move on
    assert w.optimizer_steps == 2 and not torch.equal(_log_probs(w, teacher=True), teacher_lp)
    w.load_checkpoint(str(tmp_path / "actor"))
    assert w.optimizer_steps == 1
    assert all(torch.equal(w.sdpo_teacher[n], t) for n, t in teacher.items())
    assert torch.equal(_log_probs(w), student_lp)
    assert torch.equal(_log_probs(w, teacher=True), teacher_lp)


# --- sdpo_form='topk': the live teacher's top-k through verl's logits hook -----------------------------------------


def _row_logits(module: Any, seq: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module(
            input_ids=seq[None], position_ids=torch.arange(seq.numel())[None], use_cache=False
        ).logits[0]


def test_topk_sdpo_in_the_engine_equals_core_topk_distill(worker: Any) -> None:
    """verl's engine hands the student's logits to composer's hook; per micro-batch the logged SDPO term equals
    composer_core's topk_distill (student support, tail bucket) between per-row forwards of the same module on the
    student's and on the teacher's context; and a training step moves the weights through that term alone."""
    from composer_core.loss.distill import topk_distill
    from composer_verl.config import configure
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    configure({"alpha_sdpo": 1.0, "sdpo_form": "topk", "sdpo_topk": 4})
    old, _ = _old_log_probs(worker)
    sdpo_mask = torch.ones(B, R)
    sdpo_mask[3] = 0  # a row without a teacher context
    sdpo_mask[2, :2] = 0
    g = torch.Generator().manual_seed(1)
    teacher_prompts = [torch.randint(1, 128, (n,), generator=g) for n in (3, 7, 4, 5)]

    def batch() -> Any:
        td = _batch({"old_log_probs": old, "advantages": torch.zeros(B, R), "composer_sdpo_mask": sdpo_mask})
        td["composer_teacher_prompts"] = torch.nested.as_nested_tensor(teacher_prompts, layout=torch.jagged)
        tu.assign_non_tensor(td, distillation_use_topk=True)
        return td

    worker.set_loss_fn(partial(ppo_loss, config=_actor_config("composer")))
    got = _metrics(worker.infer_batch(batch()))["composer/loss/sdpo"]

    # expected: rows as the collator left them (row 0: prompt left-padded by 2; row 1: response right-padded by 2)
    data = _batch({})
    prompts, responses = data["prompts"], data["responses"]
    att = data["attention_mask"]
    module = worker.engine.module
    per_mb = []
    for rows in ((0, 1), (2, 3)):
        total, count = 0.0, 0
        for i in rows:
            p = prompts[i][att[i, :P].bool()]
            r = responses[i][att[i, P:].bool()]
            s_logits = _row_logits(module, torch.cat([p, r]))[p.numel() - 1 : -1]
            t_logits = _row_logits(module, torch.cat([teacher_prompts[i], r]))[
                teacher_prompts[i].numel() - 1 : -1
            ]
            m = sdpo_mask[i, : r.numel()].bool()
            if m.any():
                total += float(topk_distill(s_logits, t_logits, k=4, mask=m, reduction="sum"))
            count += int(m.sum())
        per_mb.append(total / count if count else 0.0)
    assert got == pytest.approx(sum(per_mb) / 2, rel=1e-5, abs=1e-7)
    assert got > 0  # the teacher contexts differ, so the divergence is positive

    before = [p.detach().clone() for p in module.parameters()]
    m = _metrics(worker.train_mini_batch(batch()))  # advantages 0: only the top-k SDPO term has a gradient
    assert m["composer/sdpo/tokens"] > 0
    assert sum(not torch.equal(a.detach(), b) for a, b in zip(module.parameters(), before)) > 0


def test_topk_needs_the_live_teacher() -> None:
    from composer_verl.config import ComposerVerlConfig

    with pytest.raises(ValueError, match="sdpo_form='topk' with sdpo_teacher='ema'"):
        ComposerVerlConfig.from_mapping(
            {"alpha_sdpo": 1.0, "sdpo_form": "topk", "sdpo_topk": 4, "sdpo_teacher": "ema", "env": "e"}
        )
