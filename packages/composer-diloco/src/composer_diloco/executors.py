"""Executors that run N replica functions ``"package.module:function"`` with JSON keyword arguments: one
subprocess (:class:`LocalProcessExecutor`) or one Ray task (:class:`RayExecutor`) each (the README's "Executors").
"""

from __future__ import annotations

import importlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import redirect_stderr, redirect_stdout, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ._optional import require

LOG_TAIL_CHARS = 4000
_EARLY_EXIT = (
    "exited with code 0 before its function returned (no result): it stopped before finishing its steps"
)


@dataclass
class ReplicaResult:
    """One replica's outcome."""

    rank: int
    exit_code: int
    value: Any = None
    log_tail: str = ""
    log_path: str | None = None
    seconds: float = 0.0
    finished: bool = True  # False: exited 0 before its function returned (``sys.exit(0)``, ``os._exit(0)``)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.finished

    @property
    def status(self) -> str:
        return f"exit code {self.exit_code}" if self.finished else _EARLY_EXIT


class ReplicaFailedError(RuntimeError):
    """One or more replicas exited non-zero; ``results`` holds every replica's outcome."""

    def __init__(self, results: Sequence[ReplicaResult]) -> None:
        self.results = list(results)
        failed = [r for r in self.results if not r.ok]
        lines = [f"{len(failed)} of {len(self.results)} replicas failed:"]
        for r in failed:
            lines.append(f"--- replica {r.rank}: {r.status} (log: {r.log_path}) ---\n{r.log_tail.rstrip()}")
        super().__init__("\n".join(lines))


@runtime_checkable
class ServerlessExecutor(Protocol):
    """Runs one replica function per kwargs mapping and returns results in rank order."""

    def run(
        self, target: str, replica_kwargs: Sequence[Mapping[str, Any]], *, timeout_s: float | None = None
    ) -> list[ReplicaResult]: ...


def resolve(target: str) -> Callable[..., Any]:
    """Import ``"package.module:function"``."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}.")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise ValueError(f"target {target!r} is not callable.")
    return fn  # type: ignore[no-any-return]


def run_spec(path: str) -> None:
    """A replica process's body: SPEC ``{"target": "package.module:function", "kwargs": {...}, "result":
    "/path"}``; the return value is written with ``torch.save`` (read back with ``weights_only=True``)."""
    with open(path) as f:
        spec = json.load(f)
    value = resolve(spec["target"])(**spec["kwargs"])
    import torch

    torch.save(value, spec["result"])


def _check_target(target: str, replica_kwargs: Sequence[Mapping[str, Any]]) -> None:
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(f"target must be 'package.module:function', got {target!r}.")
    if not replica_kwargs:
        raise ValueError("replica_kwargs is empty: pass one mapping of keyword arguments per replica.")
    for i, kw in enumerate(replica_kwargs):
        try:
            json.dumps(dict(kw))
        except TypeError as exc:
            raise ValueError(f"replica_kwargs[{i}] must be JSON-serialisable: {exc}") from exc


class ReplicaProcess:
    """One replica subprocess with its log file and result file (used by both local modes)."""

    def __init__(
        self,
        rank: int,
        target: str,
        kwargs: Mapping[str, Any],
        workdir: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.rank = rank
        stamp = f"{rank}-{time.monotonic_ns()}"
        self.log_path = workdir / f"replica-{stamp}.log"
        self.result_path = workdir / f"replica-{stamp}.pt"
        spec_path = workdir / f"replica-{stamp}.json"
        spec_path.write_text(
            json.dumps({"target": target, "kwargs": dict(kwargs), "result": str(self.result_path)})
        )
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in finish())
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.started = time.monotonic()
        run = "import sys; from composer_diloco.executors import run_spec; run_spec(sys.argv[1])"
        cmd = [sys.executable, "-c", run, str(spec_path)]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the replica and anything it started (it leads its own process group)."""
        if self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def finish(self, timeout_s: float | None) -> ReplicaResult:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            with open(self.log_path, "ab") as f:
                f.write(
                    f"\n[composer-diloco] replica {self.rank} killed at the deadline (still running after the timeout)\n".encode()
                )
            code = -9
        self._log.close()
        value, finished = None, code != 0 or self.result_path.exists()
        if not finished:
            with open(self.log_path, "ab") as f:
                f.write(f"\n[composer-diloco] replica {self.rank} {_EARLY_EXIT}\n".encode())
        elif code == 0:
            import torch

            value = torch.load(self.result_path, weights_only=True)
        tail, seconds = self.log_text()[-LOG_TAIL_CHARS:], time.monotonic() - self.started
        return ReplicaResult(self.rank, code, value, tail, str(self.log_path), seconds, finished)


def make_workdir(workdir: str | os.PathLike[str] | None, prefix: str) -> Path:
    path = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    return path


def finish_all(procs: Sequence[ReplicaProcess], timeout_s: float | None, check: bool) -> list[ReplicaResult]:
    """Wait for ``procs`` within ``timeout_s`` in all; raise :class:`ReplicaFailedError` if ``check`` and one failed."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    results = [p.finish(None if deadline is None else max(0.1, deadline - time.monotonic())) for p in procs]
    return _checked(results, check)


def _checked(results: list[ReplicaResult], check: bool) -> list[ReplicaResult]:
    if check and not all(r.ok for r in results):
        raise ReplicaFailedError(results)
    return results


class LocalProcessExecutor:
    """Run every replica as a Python subprocess on this machine.

    Args:
        workdir: where logs/results go (a fresh temporary directory by default).
        env: extra environment variables for the replicas.
        check: raise :class:`ReplicaFailedError` (with log tails) if any replica fails.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        check: bool = True,
    ) -> None:
        self.workdir = make_workdir(workdir, "composer-diloco-")
        self.env = dict(env or {})
        self.check = check

    def run(
        self, target: str, replica_kwargs: Sequence[Mapping[str, Any]], *, timeout_s: float | None = None
    ) -> list[ReplicaResult]:
        _check_target(target, replica_kwargs)
        procs = [ReplicaProcess(i, target, kw, self.workdir, self.env) for i, kw in enumerate(replica_kwargs)]
        return finish_all(procs, timeout_s, self.check)


def _ray_replica(target: str, kwargs: dict[str, Any]) -> tuple[int, Any, str]:
    """One Ray task: run the target, capture its output, never raise."""
    buf = io.StringIO()
    with redirect_stdout(buf), redirect_stderr(buf):
        try:
            value = resolve(target)(**kwargs)
            code = 0
        except BaseException:
            traceback.print_exc()
            value, code = None, 1
    return code, value, buf.getvalue()[-LOG_TAIL_CHARS:]


def ray_temp_dir() -> str:
    """A temp dir Ray accepts: not inside the virtualenv, with a short path (else under /tmp)."""
    tmp = os.path.realpath(tempfile.gettempdir())
    if tmp.startswith(os.path.realpath(sys.prefix) + os.sep) or len(tmp) > 40:
        tmp = "/tmp"
    return tempfile.mkdtemp(prefix="ray-", dir=tmp)


class RayExecutor:
    """Run every replica as a Ray task (one CPU each by default).

    Uses the running Ray instance, or calls ``ray.init(address=address, **init_kwargs)``.
    Needs ``pip install 'composer-diloco[ray]'``.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        init_kwargs: Mapping[str, Any] | None = None,
        check: bool = True,
    ) -> None:
        self.ray = require("ray", "ray", "RayExecutor")
        if not self.ray.is_initialized():
            kwargs = dict(init_kwargs or {})
            if address is None and "_temp_dir" not in kwargs:
                kwargs["_temp_dir"] = ray_temp_dir()
            self.ray.init(address=address, **kwargs)
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.check = check

    def run(
        self, target: str, replica_kwargs: Sequence[Mapping[str, Any]], *, timeout_s: float | None = None
    ) -> list[ReplicaResult]:
        _check_target(target, replica_kwargs)
        ray = self.ray
        task = ray.remote(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_retries=0)(_ray_replica)
        start = time.monotonic()
        refs = [task.remote(target, dict(kw)) for kw in replica_kwargs]
        results = []
        for rank, ref in enumerate(refs):
            left = None if timeout_s is None else max(0.1, timeout_s - (time.monotonic() - start))
            try:
                code, value, log = ray.get(ref, timeout=left)
            except ray.exceptions.GetTimeoutError:
                ray.cancel(ref, force=True)
                log = f"[composer-diloco] replica {rank} cancelled after timeout_s={timeout_s}"
                code, value = -9, None
            except ray.exceptions.RayError as exc:  # the worker process died
                code, value, log = -1, None, str(exc)[-LOG_TAIL_CHARS:]
            results.append(ReplicaResult(rank, code, value, log, None, time.monotonic() - start))
        return _checked(results, self.check)
