"""Shared fixtures: one Lighthouse run (reference weights), one moto S3 server, one Ray instance, and a runner of
replicas as threads."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# One tiny DiLoCo job used by the fault-tolerant, serverless and Ray tests: same seeds -> same weights.
TOY_KWARGS: dict[str, Any] = {"seed": 0, "max_syncs": 2, "diloco": {"sync_every": 2}}
TOY_TARGET_FT = "composer_diloco.toy:ft_replica"
TOY_TARGET_SERVERLESS = "composer_diloco.toy:serverless_replica"


@pytest.fixture(scope="session")
def ft_reference(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """Lighthouse (min_replicas=2) + 2 real replica processes with torchft Managers over Gloo."""
    from composer_diloco.fault_tolerant import launch_fault_tolerant

    return launch_fault_tolerant(
        TOY_TARGET_FT,
        [TOY_KWARGS, TOY_KWARGS],
        lighthouse_kwargs={"min_replicas": 2},
        timeout_s=180,
        workdir=tmp_path_factory.mktemp("ft-reference"),
    )


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[dict[str, Any]]:
    """moto's ThreadedMotoServer on 127.0.0.1 with a bucket; yields fsspec storage options."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://{host}:{port}"},
    }
    import s3fs

    s3fs.S3FileSystem(**options).mkdir("diloco-test")
    yield options
    server.stop()


@pytest.fixture(scope="session")
def ray_instance() -> Iterator[Any]:
    import ray
    from composer_diloco.executors import ray_temp_dir

    # nox points TMPDIR into the virtualenv, where Ray's workers refuse to start
    options = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False, "_temp_dir": ray_temp_dir()}
    for attempt in range(3):  # Ray waits a fixed 30 s for its raylet; on an overloaded host retry
        try:
            ray.init(**options)
            break
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
            ray.shutdown()
    yield ray
    ray.shutdown()


def _in_threads(fn: Callable[[int], Any], world: int, timeout_s: float = 120.0) -> list[Any]:
    """``fn(rank)`` for every rank in its own thread: the results by rank; the first error is re-raised."""
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a replica thread did not finish"
    if errors:
        raise errors[0]
    return out


@pytest.fixture
def in_threads() -> Callable[[Callable[[int], Any], int], list[Any]]:
    """Run replicas as threads of this process: ``in_threads(fn, world)`` (see :func:`_in_threads`)."""
    return _in_threads
