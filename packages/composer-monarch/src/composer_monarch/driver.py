"""The driver: spawns the four actors on a proc mesh and runs the GRPO loop with composer's loss.

Step k: the generator samples G completions per prompt (weights v) → the rewarder scores them → group
advantages → the teacher's hinted logits (channel 2) and replay pairs (channel 3) → one optimiser step
of the trainer → weights v+1 go trainer → generator, teacher. With ``overlap=True`` the rollout of step
k+1 runs while step k trains, sampled one version behind (the sampler's log-probs are ``old_logprobs``
of the clipped ratio; ``composer/policy/staleness`` reports the lag). Multi-host: pass ``host_mesh``
(e.g. ``SlurmJob(...).state().hosts``) and place each role at ``(host, proc)``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from composer_core.sdpo.context import TeacherContextOptions
from composer_core.sdpo.teacher import TeacherWeightsOptions
from monarch.actor import HostMesh, ProcMesh, this_host
from torch import Tensor, nn
from tqdm.auto import tqdm

from composer_monarch.contexts import rollout_teacher_contexts
from composer_monarch.errors import FAULTS, ActorCrashedError, Call, ProcessFailure, wait
from composer_monarch.forge_loss import ComposerLoss
from composer_monarch.generator import GeneratorActor, SamplingConfig
from composer_monarch.rewarder import RewarderActor, RewardFn
from composer_monarch.rollout import Rollout, TrainBatch, assemble_batch
from composer_monarch.task import Task
from composer_monarch.teacher import ReplayRecord, TeacherActor
from composer_monarch.trainer import TrainerActor, TrainerConfig
from composer_monarch.weights import TRANSPORTS

ROLES = ("trainer", "generator", "rewarder", "teacher")
SCALES = ("group", "batch", "none")  # composer_core.group_advantages's scale
Placement = int | tuple[int, int]


def prepare_process() -> None:
    """``spawn_procs(bootstrap=...)``, before any actor is built: actors sharing a process are built on different
    threads, and concurrent first imports race (importlib's ``KeyError``, a half-initialised ``transformers``).
    Unpickling this imports composer_monarch and every actor module; it adds the Qwen2 model code if installed."""
    if importlib.util.find_spec("transformers") is not None:
        importlib.import_module("transformers.models.qwen2")


@dataclass(frozen=True)
class LoopConfig:
    """Loop settings.

    steps: optimiser steps; prompts_per_step × group_size completions per step; overlap: sample step k+1
    while training step k; procs: processes per host; placement: role → proc (or ``(host, proc)``), by
    default the trainer alone on proc 0 and the other roles on the last proc. call_timeout_s: every actor
    call must be answered within it of its send; start_timeout_s / stop_timeout_s bound spawning / stopping
    the mesh. advantage_scale: "group" | "batch" | "none" (composer_core.group_advantages); seed: step k
    samples with seed·1_000_003 + k; num_threads: torch threads per actor process (None: torch's default).
    weight_transport: trainer → generator/teacher, never through the driver: "shm" (same host), "rdma"
    (Monarch's RDMABuffer), "direct" (one packed message), "auto" (shm, else rdma, else direct).
    """

    steps: int = 3
    prompts_per_step: int = 2
    group_size: int = 4
    overlap: bool = False
    procs: int = 2
    placement: Mapping[str, Placement] | None = None
    call_timeout_s: float = 300.0
    start_timeout_s: float = 600.0
    stop_timeout_s: float = 60.0
    advantage_scale: str = "group"
    seed: int = 0
    num_threads: int | None = 1
    weight_transport: str = "auto"

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "procs"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoopConfig.{name}={getattr(self, name)}: must be ≥ 1")
        for name in ("call_timeout_s", "start_timeout_s", "stop_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"LoopConfig.{name}={getattr(self, name)}: must be > 0 seconds")
        for name, allowed in (("weight_transport", TRANSPORTS), ("advantage_scale", SCALES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"LoopConfig.{name}={getattr(self, name)!r}: use one of {list(allowed)}")
        if unknown := sorted(set(self.placement or ()) - set(ROLES)):
            raise ValueError(f"LoopConfig.placement: unknown role(s) {unknown}; roles are {list(ROLES)}")

    def slot(self, role: str) -> tuple[int, int]:
        """(host, proc) of ``role``: its ``placement``, else proc 0 (trainer) or the last proc (the rest)."""
        where = (self.placement or {}).get(role, 0 if role == "trainer" else self.procs - 1)
        return where if isinstance(where, tuple) else (0, where)


@dataclass
class StepResult:
    """What one step did: the trainer's metrics, the mean reward, the seconds the step took.

    ``extra``: weights_version (after the push), pairs (channel-3 pairs), push_bytes and push_transport
    (the trainer's receipt), and the phases in seconds: train_wait_s (send → answer; with overlap it
    includes the next rollout), push_s, rollout_s (sequential only: the next step's rollout).
    """

    step: int
    metrics: dict[str, float]
    reward_mean: float
    seconds: float
    sampled_by_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class ComposerDriver:
    """Owns the proc mesh and the actors; use as a context manager (the mesh is stopped on exit).

    >>> loss = ComposerLoss(alpha_sdpo=0.5, beta_replay=0.0)  # no replay records: channel 3 off
    >>> with ComposerDriver(task, TinyQwen2(task.vocab_size), loss=loss) as d:
    ...     results = d.run()
    """

    def __init__(
        self,
        task: Task,
        model_fn: Callable[[], nn.Module],
        *,
        loss: ComposerLoss,
        loop: LoopConfig | None = None,
        trainer: TrainerConfig | None = None,
        reward_fns: Sequence[RewardFn] | None = None,
        reward_weights: Sequence[float] | None = None,
        replay: Sequence[ReplayRecord] | None = None,
        host_mesh: HostMesh | None = None,
        teacher_context: TeacherContextOptions | None = None,
        teacher_weights: TeacherWeightsOptions | None = None,
    ) -> None:
        self.task = task
        self.teacher_context = teacher_context or TeacherContextOptions()
        self.teacher_weights = teacher_weights or TeacherWeightsOptions()
        self.model_fn = model_fn
        self.loss = loss
        self.loop = loop or LoopConfig()
        self.trainer_config = trainer or TrainerConfig(num_threads=self.loop.num_threads)
        self.reward_fns = list(reward_fns) if reward_fns is not None else [task.reward]
        self.reward_weights = reward_weights
        self.replay = list(replay) if replay is not None else None
        self.host_mesh = host_mesh
        self.use_teacher_logits = loss.config.alpha_sdpo != 0.0
        self.use_pairs = loss.config.beta_replay != 0.0
        if not self.use_teacher_logits and (
            self.teacher_context.from_group or self.teacher_weights.sdpo_teacher != "live"
        ):
            raise ValueError(
                "teacher_context / teacher_weights only act on channel 2 but alpha_sdpo is 0: set alpha_sdpo > 0 "
                "in ComposerLoss or drop them"
            )
        if self.use_pairs and not self.replay:
            raise ValueError(
                "beta_replay is not 0 but no replay records were given: pass replay=[ReplayRecord, ...] "
                "(teacher actions with rewards) or set beta_replay=0.0 in ComposerLoss"
            )
        self.procs: ProcMesh | None = None
        self.actors: dict[str, Any] = {}
        self._failures: list[ProcessFailure] = []
        self._in_flight: list[Call] = []
        self._prefix = f"composer_{uuid.uuid4().hex[:8]}_"
        self.transport = ""
        self.last_push: dict[str, Any] = {}

    def __enter__(self) -> ComposerDriver:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _on_fault(self, role: str, failure: Any) -> None:
        """A failure of one of this driver's actor meshes (routed by :data:`errors.FAULTS`)."""
        detail = f"the {role} actor's process failed: {failure}"
        self._failures.append(ProcessFailure(role, self._colocated(role), detail))

    def _colocated(self, role: str) -> tuple[str, ...]:
        """The roles placed on the same process as ``role`` (itself included), in ROLES order."""
        if role not in ROLES:
            return (role,)
        return tuple(r for r in ROLES if self.loop.slot(r) == self.loop.slot(role))

    def start(self) -> None:
        """Spawn the proc mesh and the actors, and wait until all of them are constructed."""
        if self.procs is not None:
            raise RuntimeError("ComposerDriver.start(): already started")
        FAULTS.register(self._prefix, self._on_fault)
        try:
            hosts = self.host_mesh if self.host_mesh is not None else this_host()
            t, lp = self.task, self.loop
            self.procs = hosts.spawn_procs(
                per_host={"procs": lp.procs}, bootstrap=prepare_process, name="composer"
            )
            # the sampler and the loss see the same distribution (temperature)
            sampling = SamplingConfig(
                t.max_new_tokens, t.eos_id, t.pad_id, self.loss.temperature, lp.seed, lp.num_threads
            )
            args: dict[str, tuple[type, tuple[Any, ...]]] = {
                "trainer": (TrainerActor, (self.model_fn, self.loss, self.trainer_config, t.pad_id)),
                "generator": (GeneratorActor, (self.model_fn, sampling)),
                "rewarder": (RewarderActor, (self.reward_fns, self.reward_weights)),
                "teacher": (
                    TeacherActor,
                    (self.model_fn, self.replay, t.pad_id, lp.num_threads, self.teacher_weights),
                ),
            }
            for role, (cls, a) in args.items():
                self.actors[role] = self._slot(role).spawn(self._prefix + role, cls, *a)
            peers = {r: self.actors[r] for r in ("generator", "teacher")}
            connect = (peers, lp.weight_transport, lp.call_timeout_s)
            self.transport = self._call("trainer", "connect", *connect, timeout_s=lp.start_timeout_s)()
            self._push_weights(timeout_s=lp.start_timeout_s)
            self._call("rewarder", "process_id", timeout_s=lp.start_timeout_s)()
        except BaseException:
            self.stop()
            raise

    def _slot(self, role: str) -> ProcMesh:
        assert self.procs is not None
        host, proc = self.loop.slot(role)
        if not 0 <= proc < self.loop.procs:
            raise ValueError(f"placement of {role}: proc {proc} is outside 0..{self.loop.procs - 1}")
        if "hosts" in self.procs.extent.labels:
            return self.procs.slice(hosts=host, procs=proc)
        if host != 0:
            raise ValueError(f"placement of {role}: host {host} given but the mesh has one host")
        return self.procs.slice(procs=proc)

    def stop(self) -> None:
        """Stop the proc mesh (bounded by ``stop_timeout_s``); later reports about it are ignored."""
        procs, self.procs = self.procs, None
        try:
            if procs is not None:
                procs.stop("composer driver exit").get(timeout=self.loop.stop_timeout_s)
        except Exception as e:  # a mesh with a dead process may not stop cleanly
            print(f"composer-monarch: stopping the proc mesh: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            self.actors = {}
            FAULTS.unregister(self._prefix)

    def _call(
        self, role: str, endpoint: str, *args: Any, timeout_s: float | None = None
    ) -> Callable[[], Any]:
        """Send ``role.endpoint(*args)``; returns a thunk that waits for the answer, which must come
        within ``timeout_s`` (default ``call_timeout_s``) of this send. Until the thunk has run, the
        call is in flight: every other wait also enforces its deadline."""
        if not self.actors:
            raise RuntimeError("ComposerDriver is not started: use `with ComposerDriver(...) as d:`")
        fut = getattr(self.actors[role], endpoint).call_one(*args)
        call = Call(fut, role, endpoint, self.loop.call_timeout_s if timeout_s is None else timeout_s)
        self._in_flight.append(call)

        def answer() -> Any:
            try:
                return wait(call, failures=lambda: list(self._failures), others=lambda: list(self._in_flight))
            finally:
                self._in_flight[:] = [c for c in self._in_flight if c is not call]

        return answer

    @contextlib.contextmanager
    def _abandoned_on_error(self) -> Iterator[None]:
        """Calls sent inside the block and still unanswered when it raises are abandoned: the error
        already ended the step, so later waits do not enforce their deadlines."""
        before = list(self._in_flight)
        try:
            yield
        except BaseException:
            self._in_flight[:] = [c for c in self._in_flight if any(c is b for b in before)]
            raise

    def _push_weights(self, timeout_s: float | None = None) -> int:
        """The trainer sends its weights to the generator and teacher itself; the driver gets a receipt."""
        self.last_push = dict(self._call("trainer", "push_weights", timeout_s=timeout_s)())
        return int(self.last_push["version"])

    def rollout(self, step: int) -> TrainBatch:
        """Sample, score and annotate the batch of ``step`` (generator → rewarder → teacher).

        Channel 2 distils the completions the task gives a hint (``task.hinted_prompts``); when none has
        one, the teacher is not called and the step has no SDPO term.
        """
        lp = self.loop
        prompts = self.task.prompts(lp.prompts_per_step, step=step)
        with self._abandoned_on_error():
            ro: Rollout = self._call("generator", "generate", step, prompts, lp.group_size)()
            rewards: Tensor = self._call("rewarder", "score", ro)()
            key, sdpo_rows, pending = None, None, None
            if self.use_teacher_logits:
                ctx: Any
                if self.teacher_context.from_group:
                    endpoint, seed = "context_logits", lp.seed * 1_000_003 + step
                    ctx, sdpo_rows = rollout_teacher_contexts(
                        self.task, ro, rewards, self.teacher_context, seed
                    )
                else:
                    endpoint = "hinted_logits"
                    ctx, sdpo_rows = self.task.hinted_prompts(
                        ro.prompt_ids, ro.completion_ids, ro.completion_mask
                    )
                    cap = self.teacher_context.max_reprompt_len  # keep each row's last tokens (cap_reprompt)
                    ctx = ctx if cap is None else ctx[:, -cap:]
                if bool(sdpo_rows.any()):  # else no row has a hint/context: channel 2 is skipped this step
                    key = f"{step}-{uuid.uuid4().hex[:8]}"  # the logits stay on the teacher for the trainer
                    pending = self._call("teacher", endpoint, ctx, ro.completion_ids, key)
            pairs = self._call("teacher", "preference_pairs", ro, rewards)() if self.use_pairs else None
            if pending is not None:
                pending()
        return assemble_batch(
            ro,
            rewards,
            advantage_scale=lp.advantage_scale,
            teacher_key=key,
            sdpo_rows=sdpo_rows if key is not None else None,
            pairs=pairs,
        )

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step of the trainer actor on ``batch`` (no weight push)."""
        return dict(self._call("trainer", "train_step", batch)())

    def run(
        self, *, steps: int | None = None, overlap: bool | None = None, progress: bool = True
    ) -> list[StepResult]:
        """Run ``steps`` steps (default ``loop.steps``); returns one :class:`StepResult` per step.

        ``overlap`` overrides ``loop.overlap`` for this run. Steps are numbered from the trainer's
        current version, so a second ``run`` continues with fresh prompts.
        """
        steps = self.loop.steps if steps is None else steps
        lp = replace(self.loop, steps=steps, overlap=self.loop.overlap if overlap is None else overlap)
        results: list[StepResult] = []
        bar = tqdm(total=lp.steps, desc="composer-monarch GRPO", disable=not progress, unit="step")
        first = int(self._call("trainer", "version")())
        try:
            with self._abandoned_on_error():  # a failed step leaves no call in flight behind
                batch = self.rollout(first)
                for k in range(first, first + lp.steps):
                    t0 = time.perf_counter()
                    train = self._call("trainer", "train_step", batch)
                    last = k + 1 == first + lp.steps
                    nxt = self.rollout(k + 1) if lp.overlap and not last else None
                    metrics: dict[str, float] = train()
                    t1 = time.perf_counter()
                    version = self._push_weights()
                    t2 = time.perf_counter()
                    if not lp.overlap and not last:
                        nxt = self.rollout(k + 1)
                    extra = {
                        "weights_version": version,
                        "pairs": 0 if batch.pairs is None else len(batch.pairs),
                        "train_wait_s": t1 - t0,
                        "push_s": t2 - t1,
                        "push_bytes": self.last_push.get("bytes", 0),
                        "push_transport": self.last_push.get("transport", ""),
                        "rollout_s": time.perf_counter() - t2,
                    }
                    reward = float(batch.rewards.mean())
                    seconds = time.perf_counter() - t0
                    results.append(StepResult(k, metrics, reward, seconds, batch.policy_version, extra))
                    bar.update(1)
                    bar.set_postfix(
                        reward=f"{reward:.3f}", loss=f"{metrics.get('composer/loss/total', 0):.4f}"
                    )
                    if nxt is not None:
                        batch = nxt
        finally:
            bar.close()
        return results

    def process_ids(self) -> dict[str, int]:
        """Role → OS process id of the process hosting it (on its host)."""
        return {role: int(self._call(role, "process_id")()) for role in ROLES}

    def weights(self) -> dict[str, Tensor]:
        """The trainer's current weights (a copy)."""
        _, state = self._call("trainer", "weights")()
        return dict(state)


def run_grpo(
    task: Task, model_fn: Callable[[], nn.Module], *, loss: ComposerLoss, **kwargs: Any
) -> tuple[list[StepResult], dict[str, Tensor]]:
    """Spawn, run the loop, stop: returns the step results and the final weights (``kwargs``: the
    :class:`ComposerDriver` keywords, ``loop=`` included)."""
    with ComposerDriver(task, model_fn, loss=loss, **kwargs) as driver:
        results = driver.run()
        return results, driver.weights()


__all__ = ["ActorCrashedError", "ComposerDriver", "LoopConfig", "StepResult", "run_grpo"]
