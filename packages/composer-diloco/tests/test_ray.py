"""RayExecutor on a local Ray instance (ray.init(num_cpus=2)): two serverless replicas as Ray tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from composer_diloco import RayExecutor, ReplicaFailedError, ServerlessExecutor, run_serverless

TOY_KWARGS: dict[str, Any] = {"seed": 0, "max_syncs": 2, "diloco": {"sync_every": 2}}


def test_ray_runs_two_replicas_to_identical_weights(
    tmp_path: Path, ray_instance: Any, ft_reference: list[Any]
) -> None:
    executor = RayExecutor()
    assert isinstance(executor, ServerlessExecutor)
    results = run_serverless(
        executor,
        "composer_diloco.toy:serverless_replica",
        url=f"file://{tmp_path}",
        run_id="ray-run",
        world_size=2,
        kwargs=TOY_KWARGS,
        timeout_s=240,
    )
    a, b = (r.value for r in results)
    assert [r.exit_code for r in results] == [0, 0]
    assert a["weights"] == b["weights"] and a["step"] == 2
    assert a["weights"] == ft_reference[0].value["weights"] or all(
        abs(x - y) <= 1e-6
        for p, q in zip(a["weights"], ft_reference[0].value["weights"])
        for x, y in zip(p, q)
    )


def test_ray_failure_is_reported_with_traceback(ray_instance: Any) -> None:
    with pytest.raises(ReplicaFailedError) as info:
        RayExecutor().run("json:loads", [{"s": "{bad"}], timeout_s=120)
    (failed,) = info.value.results
    assert failed.exit_code == 1 and "JSONDecodeError" in failed.log_tail


def test_ray_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"composer-diloco\[ray\]"):
        RayExecutor()
