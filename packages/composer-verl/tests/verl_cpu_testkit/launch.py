"""TEST-ONLY launcher: start Ray (bounded retries), then run verl's own ``verl.trainer.main_ppo.main``.

``python -m verl_cpu_testkit.launch <hydra overrides>`` == ``python -m verl.trainer.main_ppo <overrides>``
except that Ray is started here first: Ray gives a new node a hard-coded 30 s to register with its GCS, which
a loaded 2-core CI machine can exceed; the attempt is retried (5 times, ending the processes a failed attempt left behind) instead of failing the run.
verl's ``run_ppo`` sees an initialised Ray and uses it. Workers inherit this process's environment
(VERL_PLATFORM, VERL_USE_EXTERNAL_MODULES, PYTHONPATH); composer's options travel in the Hydra config.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

RAY_START_FAILED = 75  # EX_TEMPFAIL: the machine could not start Ray in time (no training ran)


def _kill_children_started_since(before: set[int]) -> None:
    """A failed ``ray.init`` leaves the processes it started (gcs, raylet, agents): end those, by pid."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        if child.pid not in before:
            with contextlib.suppress(psutil.Error):
                child.kill()


def start_ray(attempts: int = 5) -> None:
    import psutil
    import ray

    os.environ.setdefault("RAY_agent_register_timeout_ms", "300000")
    for attempt in range(1, attempts + 1):
        before = {c.pid for c in psutil.Process().children(recursive=True)}
        try:
            ray.init(
                num_cpus=8,  # logical: verl's placement bundles ask for CPUs per worker
                num_gpus=1,  # logical: verl's resource check counts only GPU/NPU
                include_dashboard=False,
            )
            return
        except Exception as e:
            if "timed out during startup" not in str(e):
                raise
            if attempt == attempts:
                print(f"[launch] RAY_START_FAILED after {attempts} attempts: {e}", flush=True)
                _kill_children_started_since(before)
                sys.exit(RAY_START_FAILED)
            print(f"[launch] Ray startup timed out (attempt {attempt}/{attempts}); retrying", flush=True)
            ray.shutdown()
            _kill_children_started_since(before)
            time.sleep(2)


if __name__ == "__main__":
    start_ray(int(os.environ.get("VERL_CPU_TESTKIT_RAY_ATTEMPTS", "5")))
    from verl.trainer.main_ppo import main

    sys.argv = ["verl.trainer.main_ppo", *sys.argv[1:]]
    main()
