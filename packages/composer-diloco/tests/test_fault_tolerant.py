"""Fault-tolerant mode with real parts: torchft's Lighthouse on 127.0.0.1 and replica processes,
each with a real torchft Manager over Gloo, running torchft's DiLoCo."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from composer_diloco import ReplicaFailedError
from composer_diloco.fault_tolerant import FaultTolerantLauncher, Lighthouse

TOY_TARGET_FT = "composer_diloco.toy:ft_replica"
TESTS_ENV = {
    "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
}


def test_two_replicas_end_with_identical_weights(ft_reference: list[Any]) -> None:
    a, b = (r.value for r in ft_reference)
    assert [r.exit_code for r in ft_reference] == [0, 0]
    assert a["step"] == b["step"] == 2
    assert a["participants"] == b["participants"] == [2, 2]
    assert a["weights"] == b["weights"]
    assert a["losses"] != b["losses"]  # they trained on different data between syncs


def test_sigkill_one_replica_others_continue_and_restart_rejoins(tmp_path: Path) -> None:
    start, rejoin = tmp_path / "start", tmp_path / "rejoin"
    common = {"seed": 1, "max_syncs": 7, "diloco": {"sync_every": 2}, "gates": {"0": str(start)}}
    # replica 0 pauses after sync 4 until the restarted replica asks to join; replica 1 is killed
    # while it waits after sync 2; its restarted self gets no gates beyond the start
    kwargs = [
        {**common, "gates": {"0": str(start), "4": str(rejoin)}},
        {**common, "gates": {"0": str(start), "2": str(tmp_path / "never")}},
    ]
    lighthouse = {"min_replicas": 1, "join_timeout_ms": 10000, "heartbeat_timeout_ms": 1000}
    with FaultTolerantLauncher(
        "ft_targets:gated_ft_replica", kwargs, lighthouse_kwargs=lighthouse, workdir=tmp_path, env=TESTS_ENV
    ) as launcher:
        launcher.start()
        for i in (0, 1):  # both heartbeat before anyone asks for a quorum: the first quorum has both
            launcher.wait_for_log(i, r"manager ready at step 0", timeout_s=120)
        start.touch()
        launcher.wait_for_log(1, r"sync 2 done participants=2", timeout_s=120)
        killed = launcher.kill(1, signal.SIGKILL)
        assert killed.exit_code == -signal.SIGKILL
        # the survivor goes on alone (a quorum of one) through syncs 3 and 4, then waits at a gate
        launcher.wait_for_log(0, r"sync 4 done participants=1", timeout_s=60)
        launcher.replica_kwargs[1] = common  # no gate beyond the start
        launcher.restart(1)
        launcher.wait_for_log(1, r"start_quorum at step 0", timeout_s=120)
        time.sleep(0.5)  # its quorum request reaches the Lighthouse
        rejoin.touch()
        survivor, rejoined = (r.value for r in launcher.wait(timeout_s=180))
    assert survivor["step"] == rejoined["step"] == 7
    assert survivor["synced_steps"] == list(range(1, 8))
    assert survivor["participants"][:4] == [2, 2, 1, 1]
    # the restarted replica was healed to the global step (4) instead of starting over at sync 1 ...
    assert rejoined["synced_steps"] == [5, 6, 7]
    # ... and from then on both are in every quorum and end with identical weights
    assert survivor["participants"][4:] == rejoined["participants"] == [2, 2, 2]
    assert survivor["weights"] == rejoined["weights"]


def test_replica_that_exits_0_early_is_a_failure_with_its_log_tail(tmp_path: Path) -> None:
    """Issue 62: a replica whose script calls sys.exit(0) after sync 1 of 3 was reported as "0 of 1 replicas
    failed" with no log tail by wait_for_log, and as a success by wait. Now both name it, with its log tail."""
    kwargs = [{"seed": 0, "max_syncs": 3, "diloco": {"sync_every": 2}, "exit_after_sync": 1}]
    with FaultTolerantLauncher(
        "ft_targets:ft_replica_exiting_early", kwargs, workdir=tmp_path, env=TESTS_ENV
    ) as launcher:
        launcher.start()
        with pytest.raises(ReplicaFailedError) as info:
            launcher.wait_for_log(0, r"sync 3 done", timeout_s=120)
        msg = str(info.value)
        assert msg.startswith("1 of 1 replicas failed:"), msg
        assert "exited with code 0 before its function returned" in msg, msg
        assert "exiting early with status 0 after sync 1" in msg, msg  # the log tail
        with pytest.raises(ReplicaFailedError, match="1 of 1 replicas failed") as info:
            launcher.wait(timeout_s=60)
        (result,) = info.value.results
        assert not result.ok and result.exit_code == 0 and result.value is None
        assert "exiting early" in result.log_tail


def test_restart_after_every_peer_finished_is_refused(tmp_path: Path) -> None:
    """Issue 62: a replica restarted after its peers had finished trained alone from step 0, silently (no peer
    is left to heal it). Now the restart is refused in one line naming why and what to do."""
    kwargs = [{"seed": 0, "max_syncs": 1, "diloco": {"sync_every": 2}}] * 2
    with FaultTolerantLauncher(TOY_TARGET_FT, kwargs, workdir=tmp_path) as launcher:
        launcher.start()
        assert [r.value["step"] for r in launcher.wait(timeout_s=180)] == [1, 1]
        logs = sorted(tmp_path.glob("replica-1-*.log"))
        with pytest.raises(RuntimeError) as info:
            launcher.restart(1)
        assert sorted(tmp_path.glob("replica-1-*.log")) == logs  # nothing started
    msg = str(info.value)
    assert len(msg.splitlines()) == 1, msg
    assert "replica 1" in msg and "no other replica is running" in msg and "step 0" in msg, msg
    assert "start()" in msg, msg


def test_lighthouse_binds_127_0_0_1_and_accepts_an_existing_address() -> None:
    with Lighthouse(min_replicas=1) as lh:
        assert lh.address.startswith("http://127.0.0.1:")
        assert Lighthouse(lh.address).address == lh.address
    with pytest.raises(ValueError, match="http://host:port"):
        Lighthouse("127.0.0.1")


def test_launcher_rejects_reserved_kwargs() -> None:
    with pytest.raises(ValueError, match="replica_id"):
        FaultTolerantLauncher(TOY_TARGET_FT, [{"replica_id": "x"}], lighthouse="http://127.0.0.1:1")
