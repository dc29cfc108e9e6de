"""TEST-ONLY: build the tiny task and run verl's real ``python -m verl.trainer.main_ppo`` on CPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from importlib.resources import files
from pathlib import Path

from composer_verl.envs import write_env_dataset

from verl_cpu_testkit import task

TESTS_DIR = Path(__file__).resolve().parents[1]
ENV = "digit-reversal"  # composer_core.envs: the task, its reward and (with composer.env) the hints


def overrides(
    tmp: Path,
    *,
    steps: int = 3,
    extra: tuple[str, ...] = (),
    pair_columns: tuple[str, ...] = ("chosen", "rejected"),
) -> list[str]:
    model = task.build_model_dir(tmp / "model")
    train = write_env_dataset(ENV, tmp / "train.parquet", limit=16, pair_columns=pair_columns)
    return [
        f"data.train_files={train}",
        f"data.val_files={train}",
        "data.train_batch_size=2",
        "data.max_prompt_length=32",
        "data.max_response_length=6",
        "data.dataloader_num_workers=0",
        "data.shuffle=false",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype=fp32",
        "actor_rollout_ref.rollout.name=hf_generate",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",  # 8 by default: 8 Ray actors
        "reward.custom_reward_function.path=pkg://composer_verl.envs",
        "reward.custom_reward_function.name=compute_score",
        f"+reward.custom_reward_function.reward_kwargs.env={ENV}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp / 'ckpt'}",
        *extra,
    ]


def composer_overrides(composer: Mapping[str, object]) -> list[str]:
    """``+composer.<key>=<value>``: composer's options as Hydra overrides of the one ``composer:`` section."""
    text = {True: "true", False: "false", None: "null"}
    return [
        f"+composer.{k}={text.get(v, v) if isinstance(v, bool | None) else v}" for k, v in composer.items()
    ]


def run_main_ppo(
    tmp: Path,
    composer: Mapping[str, object],
    extra: tuple[str, ...] = (),
    timeout: float = 900,
    steps: int = 3,
    pair_columns: tuple[str, ...] = ("chosen", "rejected"),
) -> subprocess.CompletedProcess[str]:
    examples = str(files("composer_verl.examples"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
        "VERL_PLATFORM": "cpu",
        "VERL_USE_EXTERNAL_MODULES": "verl_cpu_testkit",
        "VERL_ENGINE_DEVICE": "cuda",  # verl's own override: pick the FSDP engine class (registered for cuda/npu)
        "RAY_DEDUP_LOGS": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "HYDRA_FULL_ERROR": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "verl_cpu_testkit.launch",
        f"--config-path={examples}",
        "--config-name=composer_grpo",
        *overrides(tmp, steps=steps, extra=extra, pair_columns=pair_columns),
        *composer_overrides(composer),
    ]
    log = tmp / "main_ppo.log"
    # Ray refuses a temp dir inside the virtualenv (nox points TMPDIR there: workers die at start and the
    # driver waits forever); a short dir under /tmp also keeps its socket paths under the length limit
    ray_tmp = tempfile.mkdtemp(prefix="composer-ray-", dir="/tmp")
    env["RAY_TMPDIR"] = ray_tmp
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True, cwd=tmp)
        try:
            returncode = proc.wait(timeout=timeout)
        finally:
            _end_tree(proc.pid)  # Ray's processes (gcs, raylet, workers) of this run, by pid
            shutil.rmtree(ray_tmp, ignore_errors=True)
    return subprocess.CompletedProcess(cmd, returncode, log.read_text(), "")


def _end_tree(pid: int) -> None:
    import contextlib

    import psutil

    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()


STEP_LINE = re.compile(r"step:(\d+) - (.*)$")


def step_metrics(stdout: str) -> dict[int, dict[str, float]]:
    """verl's console logger lines ``step:N - key:value - ...`` → {step: {key: value}}."""
    out: dict[int, dict[str, float]] = {}
    for line in stdout.splitlines():
        m = STEP_LINE.search(line)
        if not m:
            continue
        metrics: dict[str, float] = {}
        for item in m.group(2).split(" - "):
            key, _, value = item.rpartition(":")
            try:
                metrics[key.strip()] = float(value)
            except ValueError:
                continue
        out[int(m.group(1))] = metrics
    return out


if __name__ == "__main__":
    tmp = Path(sys.argv[1])
    tmp.mkdir(parents=True, exist_ok=True)
    timeout = float(os.environ.get("VERL_CPU_TESTKIT_TIMEOUT", "900"))
    composer = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    proc = run_main_ppo(tmp, composer, tuple(sys.argv[3:]), timeout=timeout)
    print(proc.stdout[-20000:])
    print(proc.stderr[-20000:], file=sys.stderr)
    print("RC", proc.returncode)
