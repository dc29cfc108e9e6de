"""TEST-ONLY parts that let verl 0.9.1's real ``main_ppo`` run on a CPU machine (never shipped).

Imported in every process of the run through verl's own ``VERL_USE_EXTERNAL_MODULES`` (``import verl``
imports it), it registers, with verl's public registries where they exist:

* ``PlatformRegistry.register("cpu")`` + ``VERL_PLATFORM=cpu``: a CPU platform (device "cpu", backend gloo,
  Ray resource "GPU" so verl's placement bundles ask for the *logical* GPU the run declares with
  ``+ray_kwargs.ray_init.num_gpus=1``; verl's resource check counts only GPU/NPU).
* ``RolloutReplicaRegistry.register("hf_generate", ...)``: a rollout replica whose server is a Ray actor running
  Hugging Face ``transformers`` forward passes (sampling token by token, returning the sampled tokens'
  log-probs). It is a stand-in for vLLM/SGLang, which have no CPU path here. verl's worker-side adapter
  table ``verl.workers.rollout.base._ROLLOUT_REGISTRY`` has no public registration function, so the
  matching worker adapter is added to that dict (the one private touch; verl is pinned exactly).
* gloo initialised before verl's own ``initialize_global_process_group_ray``: on CPU verl builds the
  backend string ``"cpu:gloo,cpu:gloo"`` (a duplicate torch refuses); an initialised group is reused.
"""

from __future__ import annotations

import os

from verl_cpu_testkit.platform import register_platform
from verl_cpu_testkit.rollout import register_rollout

ROLLOUT_NAME = "hf_generate"

register_platform()
register_rollout(ROLLOUT_NAME)


def _init_gloo_for_verl_worker() -> None:
    """In a verl worker process (RANK/WORLD_SIZE/MASTER_* set by verl's worker group), start gloo first."""
    import torch.distributed as dist

    if not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        return
    if os.environ.get("VERL_CPU_TESTKIT_NO_GLOO") or dist.is_initialized():
        return
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


_init_gloo_for_verl_worker()
