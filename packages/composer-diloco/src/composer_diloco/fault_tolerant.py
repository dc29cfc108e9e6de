"""Fault-tolerant mode: a torchft :class:`Lighthouse` plus N replica processes, each with a real
``torchft.Manager`` (:func:`make_manager`: Gloo on CPU, NCCL on GPU, ``use_async_quorum=False``).
:class:`FaultTolerantLauncher` starts, kills and restarts replicas; a restarted one joins the next quorum,
where torchft heals it from a healthy peer.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from .executors import ReplicaFailedError, ReplicaProcess, ReplicaResult, finish_all, make_workdir


class Lighthouse(AbstractContextManager["Lighthouse"]):
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
    from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

    if not replica_id or not re.fullmatch(r"[A-Za-z0-9_.-]+", replica_id):
        raise ValueError(f"replica_id must be a non-empty [A-Za-z0-9_.-] string, got {replica_id!r}.")
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=timeout_s)
    pg_class = ProcessGroupBabyNCCL if torch.device(device).type == "cuda" else ProcessGroupGloo
    pg = pg_class(timeout=timeout)
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


class FaultTolerantLauncher(AbstractContextManager["FaultTolerantLauncher"]):
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
        self.workdir = make_workdir(workdir, "composer-diloco-ft-")
        self.env = dict(env or {})
        self.procs: dict[int, ReplicaProcess] = {}

    def start(self) -> FaultTolerantLauncher:
        """Start every replica (again, from step 0, once none is running)."""
        for i in range(len(self.replica_kwargs)):
            self._spawn(i)
        return self

    def kill(self, i: int, sig: int = signal.SIGKILL) -> ReplicaResult:
        """Kill replica ``i`` (SIGKILL by default) and return its (failed) result."""
        p = self.procs[i]
        if p.proc.poll() is None:
            p.proc.send_signal(sig)
        return p.finish(timeout_s=30)

    def restart(self, i: int) -> None:
        """Restart replica ``i`` with ``replica_kwargs[i]``: it joins the next quorum and is healed from a
        running peer. Refused when no other replica is running (none could heal it: it would train alone from
        step 0)."""
        peers = [j for j in sorted(self.procs) if j != i]
        if peers and all(self.procs[j].proc.poll() is not None for j in peers):
            raise RuntimeError(
                f"replica {i} cannot rejoin: no other replica is running (replicas {peers} have exited), so none "
                "can heal it and it would train alone from step 0; restart it while a peer still runs, or run "
                "every replica again with start()."
            )
        self._spawn(i)

    def _spawn(self, i: int) -> None:
        if i in self.procs and self.procs[i].proc.poll() is None:
            raise RuntimeError(f"replica {i} is still running; kill it before restarting.")
        kwargs = {**self.replica_kwargs[i], "lighthouse_addr": self.lighthouse.address, "replica_id": str(i)}
        self.procs[i] = ReplicaProcess(i, self.target, kwargs, self.workdir, self.env)

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
                result = p.finish(timeout_s=1)
                if not result.ok:
                    raise ReplicaFailedError([result])
                raise RuntimeError(
                    f"replica {i} finished without logging {pattern!r}; log tail:\n{result.log_tail[-2000:]}"
                )
            time.sleep(0.05)
        raise TimeoutError(
            f"replica {i} did not log {pattern!r} within {timeout_s}s; log tail:\n{self.procs[i].log_text()[-2000:]}"
        )

    def wait(self, timeout_s: float | None = None, *, check: bool = True) -> list[ReplicaResult]:
        """Wait for the current process of every replica; raise with log tails if any failed."""
        return finish_all([self.procs[i] for i in sorted(self.procs)], timeout_s, check)

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()
        if self._own_lighthouse:
            self.lighthouse.shutdown()

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
