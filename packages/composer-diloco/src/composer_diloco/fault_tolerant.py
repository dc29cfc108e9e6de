"""Fault-tolerant mode: a torchft Lighthouse plus N replica processes, each with a real
``torchft.Manager`` (Gloo on CPU, NCCL on GPU).

* :class:`Lighthouse` starts ``torchft``'s Lighthouse on 127.0.0.1 (or wraps the address of one
  that is already running).
* :func:`make_manager` builds one replica group's ``Manager``: its own ``TCPStore`` on
  127.0.0.1, a reconfigurable process group, ``use_async_quorum=False`` (DiLoCo needs it) and
  ``hostname="127.0.0.1"``.
* :class:`FaultTolerantLauncher` starts the replicas as subprocesses, can kill and restart any
  of them, and collects results. A restarted replica joins the next quorum, where torchft heals
  it: it receives the current step, the model/inner-optimiser state and DiLoCo's global copy
  and outer optimiser (``StreamingDiLoCoFragment_*``) from a healthy peer.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .executors import ReplicaFailedError, ReplicaProcess, ReplicaResult


class Lighthouse:
    """A torchft Lighthouse on ``host`` (default 127.0.0.1), or an existing one's ``address``.

    Args:
        address: connect to this running Lighthouse (``http://host:port``) instead of starting one.
        host / port: where to bind a new one (port 0 picks a free port).
        min_replicas: the smallest quorum the Lighthouse forms.
        join_timeout_ms: how long a quorum waits for replicas that are alive but not yet asking.
        heartbeat_timeout_ms: after this silence a replica is considered dead.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        min_replicas: int = 1,
        join_timeout_ms: int = 2000,
        quorum_tick_ms: int = 50,
        heartbeat_timeout_ms: int = 1000,
    ) -> None:
        self._server: Any = None
        if address is not None:
            if not re.fullmatch(r"https?://[^/\s]+:\d+", address):
                raise ValueError(f"address must look like 'http://host:port', got {address!r}.")
            self.address = address
            return
        if not isinstance(min_replicas, int) or min_replicas < 1:
            raise ValueError(f"min_replicas must be an int >= 1, got {min_replicas!r}.")
        from torchft._torchft import LighthouseServer

        self._server = LighthouseServer(
            bind=f"{host}:{port}",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        bound_port = int(str(self._server.address()).rsplit(":", 1)[1])
        self.address = f"http://{host}:{bound_port}"

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


@dataclass
class ReplicaGroup:
    """What :func:`make_manager` built (keep it alive as long as the manager is used)."""

    manager: Any
    store: Any
    pg: Any

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def make_process_group(device: torch.device | str, timeout: timedelta) -> Any:
    """torchft's reconfigurable process group: NCCL for CUDA devices, Gloo otherwise."""
    from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

    if torch.device(device).type == "cuda":
        return ProcessGroupBabyNCCL(timeout=timeout)
    return ProcessGroupGloo(timeout=timeout)


def make_manager(
    *,
    lighthouse_addr: str,
    replica_id: str,
    load_state_dict: Callable[[Any], None],
    state_dict: Callable[[], Any],
    min_replica_size: int = 1,
    device: torch.device | str = "cpu",
    timeout_s: float = 30.0,
    quorum_timeout_s: float = 60.0,
    init_sync: bool = False,
    host: str = "127.0.0.1",
) -> ReplicaGroup:
    """A ``torchft.Manager`` for one single-process replica group on ``host``.

    ``init_sync=False`` assumes every replica initialises its model identically (same seed), as
    torchft recommends; a replica that joins late is still healed from a peer.
    """
    from torch.distributed import TCPStore  # type: ignore[attr-defined]
    from torchft.manager import Manager

    if not replica_id or not re.fullmatch(r"[A-Za-z0-9_.-]+", replica_id):
        raise ValueError(f"replica_id must be a non-empty [A-Za-z0-9_.-] string, got {replica_id!r}.")
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=timeout_s)
    pg = make_process_group(device, timeout)
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=min_replica_size,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=quorum_timeout_s),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        replica_id=replica_id,
        hostname=host,
        init_sync=init_sync,
    )
    return ReplicaGroup(manager=manager, store=store, pg=pg)


class FaultTolerantLauncher:
    """Start a Lighthouse (or use ``lighthouse``) and N replica subprocesses.

    Each replica runs ``target`` (``"package.module:function"``) with its kwargs plus
    ``lighthouse_addr`` and ``replica_id`` (``"0"``, ``"1"``, …). Replicas may be killed
    (:meth:`kill`) and restarted (:meth:`restart`) while the others keep training.

    Args:
        target: the replica function.
        replica_kwargs: one JSON-serialisable mapping per replica.
        lighthouse: an address of a running Lighthouse, a :class:`Lighthouse`, or None to start one.
        lighthouse_kwargs: options for the Lighthouse started here.
        workdir: where logs and results go.
    """

    def __init__(
        self,
        target: str,
        replica_kwargs: Sequence[Mapping[str, Any]],
        *,
        lighthouse: str | Lighthouse | None = None,
        lighthouse_kwargs: Mapping[str, Any] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not replica_kwargs:
            raise ValueError("replica_kwargs is empty: pass one mapping per replica.")
        self.target = target
        self.replica_kwargs = [dict(kw) for kw in replica_kwargs]
        for i, kw in enumerate(self.replica_kwargs):
            clash = {"lighthouse_addr", "replica_id"} & set(kw)
            if clash:
                raise ValueError(f"replica_kwargs[{i}] sets {sorted(clash)}; the launcher provides them.")
        self._own_lighthouse = not isinstance(lighthouse, (str, Lighthouse))
        if isinstance(lighthouse, Lighthouse):
            self.lighthouse = lighthouse
        else:
            self.lighthouse = Lighthouse(lighthouse, **dict(lighthouse_kwargs or {}))
        self.workdir = (
            Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="composer-diloco-ft-"))
        )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env or {})
        self.procs: dict[int, ReplicaProcess] = {}
        self.killed: list[ReplicaResult] = []

    def _kwargs(self, i: int) -> dict[str, Any]:
        return {**self.replica_kwargs[i], "lighthouse_addr": self.lighthouse.address, "replica_id": str(i)}

    def start(self) -> FaultTolerantLauncher:
        for i in range(len(self.replica_kwargs)):
            self.start_replica(i)
        return self

    def start_replica(self, i: int) -> None:
        if i in self.procs and self.procs[i].proc.poll() is None:
            raise RuntimeError(f"replica {i} is still running; kill it before restarting.")
        self.procs[i] = ReplicaProcess(i, self.target, self._kwargs(i), self.workdir, self.env)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> ReplicaResult:
        """Kill replica ``i`` (SIGKILL by default) and return its (failed) result."""
        p = self.procs[i]
        if p.proc.poll() is None:
            p.proc.send_signal(sig)
        result = p.finish(timeout_s=30)
        self.killed.append(result)
        return result

    def restart(self, i: int) -> None:
        self.start_replica(i)

    def wait_for_log(self, i: int, pattern: str, timeout_s: float = 60.0) -> str:
        """Block until replica ``i``'s log matches ``pattern`` (regex); return the match."""
        deadline = time.monotonic() + timeout_s
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            p = self.procs[i]
            m = rx.search(p.log_text())
            if m:
                return m.group(0)
            if p.proc.poll() is not None:
                raise ReplicaFailedError([p.finish(timeout_s=1)])
            time.sleep(0.05)
        raise TimeoutError(
            f"replica {i} did not log {pattern!r} within {timeout_s}s; log tail:\n{self.procs[i].log_text()[-2000:]}"
        )

    def wait(self, timeout_s: float | None = None, *, check: bool = True) -> list[ReplicaResult]:
        """Wait for the current process of every replica; raise with log tails if any failed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results = []
        for i in sorted(self.procs):
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            results.append(self.procs[i].finish(left))
        if check and not all(r.ok for r in results):
            raise ReplicaFailedError(results)
        return results

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()
        if self._own_lighthouse:
            self.lighthouse.shutdown()

    def __enter__(self) -> FaultTolerantLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch_fault_tolerant(
    target: str,
    replica_kwargs: Sequence[Mapping[str, Any]],
    *,
    lighthouse: str | Lighthouse | None = None,
    lighthouse_kwargs: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
    workdir: str | os.PathLike[str] | None = None,
) -> list[ReplicaResult]:
    """Run N fault-tolerant replicas to completion and return their results."""
    with FaultTolerantLauncher(
        target, replica_kwargs, lighthouse=lighthouse, lighthouse_kwargs=lighthouse_kwargs, workdir=workdir
    ) as launcher:
        launcher.start()
        return launcher.wait(timeout_s)
