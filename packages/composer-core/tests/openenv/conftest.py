"""Real OpenEnv server processes on 127.0.0.1, one per mode, started in parallel once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("openenv.core", reason="needs composer-core[openenv]")

from composer_testkit.env_server import EnvServerProcess

MODES = {
    "ok": ("--n-tasks", "16"),
    "slow": ("--fault", "slow", "--slow-s", "60"),
    "garbage": ("--fault", "garbage"),
    "schema": ("--fault", "schema"),
}


@pytest.fixture(scope="session")
def servers() -> Iterator[dict[str, str]]:
    procs = {mode: EnvServerProcess(*args) for mode, args in MODES.items()}
    try:
        for p in procs.values():
            p.start(wait=False)
        yield {mode: p.wait_ready().url for mode, p in procs.items()}
    finally:
        for p in procs.values():
            p.__exit__(None, None, None)
