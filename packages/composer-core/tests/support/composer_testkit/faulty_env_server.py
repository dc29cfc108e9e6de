"""The digit-reversal OpenEnv server with a fault, for tests of the client's fault handling.

``python faulty_env_server.py --fault slow|garbage|schema [--slow-s S] <openenv_digit_reversal's options>``:
``slow`` (every step sleeps ``--slow-s`` seconds), ``garbage`` (the session WebSocket answers non-JSON),
``schema`` (it answers JSON of the wrong shape). Reset, the Task API and ``/health`` stay healthy in every mode.
It patches the real server module in this process only, then runs its ``main``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any

if __name__ == "__main__":  # no Gradio web UI, as the real server when run as __main__
    sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]

from composer_core.envs import openenv_digit_reversal as srv
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from openenv.core.env_server import HTTPEnvServer

FAULTS = ("none", "slow", "garbage", "schema")


def _slow(slow_s: float) -> None:
    step = srv.DigitReversalOpenEnv.step

    def slow_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(slow_s)
        return step(self, *args, **kwargs)

    srv.DigitReversalOpenEnv.step = slow_step  # type: ignore[method-assign]


def _faulty_ws(fault: str) -> None:
    """A session WebSocket that answers garbage (registered before OpenEnv's, so it wins the route)."""
    schema = {"type": "observation", "data": {"observation": "oops", "reward": "high", "done": "maybe"}}
    answer = "<html>502 Bad Gateway</html>" if fault == "garbage" else json.dumps(schema)
    register = HTTPEnvServer.register_routes

    def register_faulty(self: Any, app: FastAPI, *args: Any, **kwargs: Any) -> Any:
        @app.websocket("/ws")
        async def faulty(websocket: WebSocket) -> None:
            await websocket.accept()
            with contextlib.suppress(WebSocketDisconnect):
                while True:
                    await websocket.receive_text()
                    await websocket.send_text(answer)

        return register(self, app, *args, **kwargs)

    HTTPEnvServer.register_routes = register_faulty


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--slow-s", type=float, default=30.0, help="seconds every step sleeps with --fault slow")
    args, rest = p.parse_known_args(argv)
    if args.fault == "slow":
        _slow(args.slow_s)
    elif args.fault in ("garbage", "schema"):
        _faulty_ws(args.fault)
    srv.main(rest)


if __name__ == "__main__":
    main()
