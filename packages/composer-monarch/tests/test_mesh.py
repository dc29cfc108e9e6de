"""The loop on a real Monarch proc mesh (torchmonarch): ≥ 2 processes, tiny Qwen2, CPU."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest
import torch
from composer_core import ADAPTER_PREFIX, METRIC_KEYS, OPTIONAL_METRIC_KEYS
from composer_monarch import ComposerDriver, ComposerLoss, LoopConfig, PolicyTrainer, ReplayRecord, TinyQwen2
from composer_monarch.rollout import TrainBatch
from composer_monarch.task import ReverseDigits
from composer_monarch.trainer import TrainerConfig

TASK = ReverseDigits(n_digits=8, length=3)
MODEL = TinyQwen2(TASK.vocab_size, seed=0)


def oracle_replay(steps: int, n: int) -> list[ReplayRecord]:
    """Replayed actions of an 'oracle teacher' (the correct answer, reward 1) for the prompts of each step."""
    return [
        ReplayRecord(p, TASK.target(p), 1.0, "oracle") for s in range(steps) for p in TASK.prompts(n, step=s)
    ]


LOSS = ComposerLoss(loss_type="grpo", alpha_sdpo=0.5, beta_replay=0.5, dpo_beta=0.1)
LOOP = LoopConfig(steps=3, prompts_per_step=2, group_size=4, overlap=True, call_timeout_s=120)


@pytest.fixture(scope="module")
def driver():  # type: ignore[no-untyped-def]
    with ComposerDriver(TASK, MODEL, loss=LOSS, loop=LOOP, replay=oracle_replay(12, 2)) as d:
        yield d


def _version(d: ComposerDriver) -> int:
    return int(d._call("trainer", "version")())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_loop_runs_three_steps_on_two_processes_and_policy_changes(driver: ComposerDriver) -> None:
    pids = driver.process_ids()
    assert pids["trainer"] != pids["generator"]  # trainer alone on proc 0, the rest on proc 1
    assert pids["generator"] == pids["rewarder"] == pids["teacher"]
    assert os.getpid() not in pids.values()
    before = driver.weights()
    first = _version(driver)
    results = driver.run(steps=3, overlap=True, progress=False)
    after = driver.weights()
    assert [r.step for r in results] == [first, first + 1, first + 2]
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)  # every tensor moved
    for r in results:
        assert (
            r.metrics["composer/sdpo/skipped"] == 0.0 and r.metrics["composer/sdpo/tokens"] > 0
        )  # channel 2 ran
        assert r.metrics["composer/replay/skipped"] == 0.0 and r.extra["pairs"] > 0  # channel 3 ran
        # composer-core's keys (of the option-only ones, TorchForge's default kl_beta=0.1 adds policy/kl)
        # under composer/, plus the trainer's own
        core = set(METRIC_KEYS) - OPTIONAL_METRIC_KEYS | {"policy/kl"}
        extras = {"train/grad_norm", "reward/mean", "policy/staleness"}
        assert set(r.metrics) == {ADAPTER_PREFIX + k for k in core | extras}
        assert r.extra["weights_version"] == r.step + 1  # trainer → generator after every step
    # overlap: step k+1 was sampled while step k trained, by the weights one step behind
    assert results[0].sampled_by_version == first
    assert [r.sampled_by_version for r in results[1:]] == [first, first + 1]
    assert [r.metrics["composer/policy/staleness"] for r in results[1:]] == [1.0, 1.0]


def test_sequential_run_is_on_policy(driver: ComposerDriver) -> None:
    first = _version(driver)
    results = driver.run(steps=2, overlap=False, progress=False)
    assert [r.sampled_by_version for r in results] == [first, first + 1]
    assert all(r.metrics["composer/policy/staleness"] == 0.0 for r in results)


def test_train_step_on_mesh_equals_in_process_bit_exact(driver: ComposerDriver) -> None:
    state = driver._call("trainer", "state")()
    batch = driver.rollout(int(state["version"]))  # a real rollout: generator, rewarder, teacher
    # the hinted logits stay on the teacher; the mesh trainer takes them from there itself
    assert batch.teacher_logits is None and batch.teacher_key is not None and batch.pairs is not None
    # the local trainer gets the same logits: the teacher (same weights, no push since) scores them again
    hinted, _ = TASK.hinted_prompts(batch.prompt_ids, batch.completion_ids, batch.completion_mask)
    driver._call("teacher", "hinted_logits", hinted, batch.completion_ids, "local")()
    local_batch = replace(batch, teacher_logits=driver._call("teacher", "take_logits", "local")())
    local = PolicyTrainer(MODEL, LOSS, TrainerConfig(num_threads=LOOP.num_threads), pad_id=TASK.pad_id)
    local.load_state(state)
    local_metrics = local.train_step(local_batch)
    mesh_metrics = driver.train_step(batch)
    mesh_weights = driver.weights()
    local_weights = local.weights()
    assert mesh_weights.keys() == local_weights.keys()
    for k in mesh_weights:
        assert torch.equal(mesh_weights[k], local_weights[k]), k
    assert mesh_metrics == local_metrics
    assert not torch.equal(mesh_weights["lm_head.weight"], state["model"]["lm_head.weight"])


class FaultyReward:
    """Reward function that behaves per call number (counted in the rewarder's process)."""

    def __init__(self, plan: dict[int, str]) -> None:
        self.plan = plan
        self.calls = 0

    def __call__(self, prompt: torch.Tensor, completion: torch.Tensor) -> float:
        self.calls += 1
        what = self.plan.get(self.calls)
        if what == "raise":
            raise ValueError("verifier exploded on purpose")
        if what == "hang":
            time.sleep(600)
        if what == "die":
            os._exit(7)
        return TASK.reward(prompt, completion)


def test_actor_that_raises_or_hangs_fails_the_driver_in_bounded_time() -> None:
    from composer_monarch import ActorCrashedError, ActorTimeoutError

    per_step = LOOP.prompts_per_step * LOOP.group_size  # reward calls per rollout
    plan = {per_step + 3: "raise", 3 * per_step + 1: "hang"}
    # one process is enough here (and halves the start-up cost)
    loop = LoopConfig(steps=3, prompts_per_step=2, group_size=4, procs=1, call_timeout_s=8, stop_timeout_s=30)
    loss = ComposerLoss(loss_type="grpo", alpha_sdpo=0.0, beta_replay=0.0)
    with ComposerDriver(TASK, MODEL, loss=loss, loop=loop, reward_fns=[FaultyReward(plan)]) as d:
        pids = set(d.process_ids().values())
        t0 = time.monotonic()
        with pytest.raises(ActorCrashedError, match="verifier exploded on purpose") as err:
            d.run(progress=False)  # step 0 trains, the rollout of step 1 raises
        assert time.monotonic() - t0 < 60
        assert err.value.role == "rewarder" and err.value.endpoint == "score"
        assert isinstance(err.value.remote_exception, ValueError)
        # the mesh survives an exception in an endpoint; the next rollout's reward call hangs
        d.rollout(1)
        t0 = time.monotonic()
        with pytest.raises(ActorTimeoutError, match="rewarder actor did not answer 'score' within 8 s"):
            d.rollout(2)
        assert time.monotonic() - t0 < 8 + 5
    # leaving the context stopped the mesh: its processes are gone
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_alive(p) for p in pids)


def test_dead_actor_process_fails_the_driver_in_bounded_time() -> None:
    from composer_monarch import ActorCrashedError

    loop = LoopConfig(
        steps=2, prompts_per_step=1, group_size=2, procs=1, call_timeout_s=120, stop_timeout_s=30
    )
    loss = ComposerLoss(loss_type="grpo", alpha_sdpo=0.0, beta_replay=0.0)
    with ComposerDriver(TASK, MODEL, loss=loss, loop=loop, reward_fns=[FaultyReward({1: "die"})]) as d:
        t0 = time.monotonic()
        with pytest.raises(ActorCrashedError, match="exited with non-zero code 7"):
            d.run(progress=False)
        assert time.monotonic() - t0 < 60  # Monarch's supervision notices a dead process in ~10 s


def test_killed_process_is_reported_by_the_role_it_hosts_not_the_call_waited_on() -> None:
    """SIGKILL the generator's process while the driver waits on the rewarder (on its own process, hung
    in a reward function): the error names the generator, and says which call the driver waited on."""
    from composer_monarch import ActorCrashedError

    placement = {"trainer": 0, "teacher": 0, "generator": 1, "rewarder": 2}
    loop = LoopConfig(
        steps=1, prompts_per_step=1, group_size=2, procs=3, placement=placement, call_timeout_s=120
    )
    loss = ComposerLoss(kl_beta=0.0, alpha_sdpo=0.0, beta_replay=0.0)
    with ComposerDriver(TASK, MODEL, loss=loss, loop=loop, reward_fns=[FaultyReward({1: "hang"})]) as d:
        pids = d.process_ids()
        assert len({pids["trainer"], pids["generator"], pids["rewarder"]}) == 3
        rollout = d._call("generator", "generate", 0, TASK.prompts(1, step=0), 2)()
        scoring = d._call("rewarder", "score", rollout)  # hangs in the reward function
        os.kill(pids["generator"], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(
            ActorCrashedError, match="the generator actor failed while the driver waited on"
        ) as err:
            scoring()
        assert time.monotonic() - t0 < 60  # Monarch's supervision notices a dead process in ~10 s
        assert err.value.role == "generator" and err.value.roles == ("generator",)
        assert err.value.waiting_on == "rewarder" and err.value.endpoint == "score"
        assert not _alive(pids["generator"]) and _alive(pids["rewarder"])


class HangingTrainLoss(ComposerLoss):
    """A loss whose forward never returns: the trainer hangs in ``train_step``."""

    def __call__(self, logits: torch.Tensor, **targets: torch.Tensor) -> torch.Tensor:
        time.sleep(600)
        raise AssertionError("unreachable")


class SlowReward:
    """Reward function that sleeps ``seconds`` on every call after the first ``fast`` calls."""

    def __init__(self, fast: int, seconds: float) -> None:
        self.fast, self.seconds, self.calls = fast, seconds, 0

    def __call__(self, prompt: torch.Tensor, completion: torch.Tensor) -> float:
        self.calls += 1
        if self.calls > self.fast:
            time.sleep(self.seconds)
        return TASK.reward(prompt, completion)


def test_overlap_train_step_deadline_counts_from_its_send() -> None:
    """Overlap mode: train_step is sent, then the next rollout runs (≥ 0.8·T here: two reward calls of
    0.4·T each). A hung trainer must fail the run at T after the send, not after rollout + T (≥ 1.8·T)."""
    from composer_monarch import ActorTimeoutError

    timeout = 12.0
    loop = LoopConfig(steps=2, prompts_per_step=1, group_size=2, overlap=True, call_timeout_s=timeout)
    loss = HangingTrainLoss(kl_beta=0.0, alpha_sdpo=0.0, beta_replay=0.0)
    reward = SlowReward(fast=2, seconds=0.4 * timeout)  # rollout 0 is fast, rollout 1 takes ≥ 0.8·T
    with ComposerDriver(TASK, MODEL, loss=loss, loop=loop, reward_fns=[reward]) as d:
        done: list[float] = []  # when each rollout returned; train_step is sent right after rollout 0
        rollout = d.rollout

        def timed_rollout(step: int) -> TrainBatch:
            batch = rollout(step)
            done.append(time.monotonic())
            return batch

        d.rollout = timed_rollout  # type: ignore[method-assign]
        with pytest.raises(ActorTimeoutError, match="trainer actor did not answer 'train_step'") as err:
            d.run(progress=False)
        since_send = time.monotonic() - done[0]
    assert err.value.role == "trainer" and err.value.endpoint == "train_step"
    assert len(done) == 1 or done[1] - done[0] >= 0.8 * timeout  # rollout 1 was as slow as planned
    assert timeout - 0.5 <= since_send < 1.6 * timeout  # the old bound: ≥ 0.8·T + T


def test_same_loop_on_a_two_host_mesh() -> None:
    """Monarch's ProcessJob runs each 'host' as a local worker process: a real 2-host HostMesh."""
    from monarch.job import ProcessJob

    job = ProcessJob({"hosts": 2})
    try:
        hosts = job.state(cached_path=None).hosts
        placement = {"trainer": (0, 0), "generator": (1, 0), "rewarder": (1, 0), "teacher": (1, 0)}
        loop = LoopConfig(
            steps=3, prompts_per_step=2, group_size=2, procs=1, overlap=True, placement=placement
        )
        loss = ComposerLoss(loss_type="grpo", alpha_sdpo=0.5, beta_replay=0.0)
        with ComposerDriver(TASK, MODEL, loss=loss, loop=loop, host_mesh=hosts) as d:
            assert d.procs is not None
            assert dict(zip(d.procs.extent.labels, d.procs.extent.sizes)) == {"hosts": 2, "procs": 1}
            pids = d.process_ids()
            assert pids["trainer"] != pids["generator"] == pids["teacher"] == pids["rewarder"]
            before = d.weights()
            results = d.run(progress=False)
            after = d.weights()
        assert [r.sampled_by_version for r in results] == [0, 0, 1]
        assert all(not torch.equal(before[k], after[k]) for k in before)
    finally:
        job.kill()
