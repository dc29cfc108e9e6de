"""A real OpenEnv environment server process for tests (``composer-core[openenv]``; pytest-free).

:class:`EnvServerProcess` runs ``python -m composer_core.envs.openenv_digit_reversal`` (or, given ``--fault``,
:mod:`composer_testkit.faulty_env_server`, which wraps it) on a free port and waits,
bounded by ``startup_s``, until its ``/health`` answers (``start(wait=False)`` then :meth:`~EnvServerProcess.wait_ready`
boots several in parallel). A server that exits during startup is restarted on another port, at most
``retries`` times; one not up by the deadline is killed and reported with the tail of its log.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

__all__ = ["EnvServerProcess", "free_port"]

MODULE = "composer_core.envs.openenv_digit_reversal"
FAULTY = str(Path(__file__).with_name("faulty_env_server.py"))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EnvServerProcess:
    """``with EnvServerProcess("--fault", "slow") as srv: srv.url`` (see the module docstring)."""

    def __init__(
        self, *args: str, startup_s: float = 240.0, retries: int = 2, host: str = "127.0.0.1"
    ) -> None:
        self.args, self.startup_s, self.retries, self.host = args, startup_s, retries, host
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.mkstemp(prefix="composer-envserver-", suffix=".log")[1])
        self._deadline = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _spawn(self) -> None:
        self.port = free_port(self.host)
        run = [FAULTY] if "--fault" in self.args else ["-m", MODULE]
        cmd = [sys.executable, *run, "--host", self.host, "--port", str(self.port), *self.args]
        with self._log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def start(self, wait: bool = True) -> EnvServerProcess:
        self._deadline = time.monotonic() + self.startup_s
        self._spawn()
        if wait:
            self.wait_ready()
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def wait_ready(self) -> EnvServerProcess:
        """Block until ``/health`` answers (restarting a server that died during startup), or raise."""
        retries = self.retries
        while time.monotonic() < self._deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                if retries == 0:
                    break
                retries -= 1
                self._spawn()
                continue
            if self._healthy():
                return self
            time.sleep(0.25)
        self.stop()
        tail = self._log.read_text(errors="replace")[-2000:]
        raise RuntimeError(
            f"OpenEnv server {' '.join(self.args)} not up within {self.startup_s:g}s; log:\n{tail}"
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> EnvServerProcess:
        return self.start() if self.proc is None else self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.unlink(missing_ok=True)
