"""Errors the driver raises when an actor fails, and the bounded wait that produces them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import monarch.actor as monarch_actor
from monarch.actor import ActorError, Future


class ActorCrashedError(RuntimeError):
    """An actor raised, or its process died, while the driver waited on it.

    ``role`` (trainer, generator, rewarder, teacher), ``endpoint`` and, when the actor raised,
    ``remote_exception`` (the exception object from the actor's process) say what failed.
    """

    def __init__(self, role: str, endpoint: str, detail: str, remote_exception: BaseException | None = None):
        self.role = role
        self.endpoint = endpoint
        self.remote_exception = remote_exception
        super().__init__(f"composer-monarch: the {role} actor failed in {endpoint!r}: {detail}")


class ActorTimeoutError(TimeoutError):
    """An actor did not answer within the driver's ``call_timeout_s``."""

    def __init__(self, role: str, endpoint: str, timeout_s: float):
        self.role = role
        self.endpoint = endpoint
        super().__init__(
            f"composer-monarch: the {role} actor did not answer {endpoint!r} within {timeout_s:.0f} s "
            "(raise LoopConfig.call_timeout_s if the step is legitimately slower)"
        )


def wait(
    future: Future[Any],
    *,
    role: str,
    endpoint: str,
    timeout_s: float,
    failures: Callable[[], list[Any]],
    poll_s: float = 0.2,
) -> Any:
    """``future.get()`` in slices of ``poll_s`` seconds, bounded by ``timeout_s``.

    Between slices it checks ``failures()`` — the mesh failures Monarch's supervision reported to the
    driver (a process that died) — so a dead actor ends the wait with :class:`ActorCrashedError`
    instead of a hang. An exception raised inside the actor becomes :class:`ActorCrashedError` with
    the remote exception attached.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ActorTimeoutError(role, endpoint, timeout_s)
        try:
            return future.get(timeout=min(poll_s, left))
        except TimeoutError:
            seen = failures()
            if seen:
                raise ActorCrashedError(role, endpoint, f"while waiting on it, {seen[0]}") from None
        except ActorError as e:
            raise ActorCrashedError(role, endpoint, str(e).strip(), e.exception) from e
        except Exception as e:  # supervision errors and other runtime failures from Monarch
            raise ActorCrashedError(role, endpoint, f"{type(e).__name__}: {e}") from e


class _FaultRouter:
    """Monarch's ``unhandled_fault_hook`` while composer drivers exist in this process.

    Monarch calls the hook when a mesh fails and nobody handled it; its default exits the client
    (``KeyboardInterrupt`` in the main thread). The router sends failures of a driver's actor meshes
    (named ``composer_<token>_<role>``) to that driver, drops late reports about stopped drivers'
    meshes and about proc meshes' internal ``logger``/``setup`` actors (they fail together with the
    actors on the same process, which are reported by name), and passes everything else to the hook
    that was installed before. It stays installed once set (late reports arrive after a mesh stops).
    """

    def __init__(self) -> None:
        self.sinks: dict[str, Callable[[str, Any], None]] = {}
        self.previous: Callable[[Any], Any] | None = None
        self.lock = threading.Lock()

    def __call__(self, failure: Any) -> None:
        name = str(getattr(failure, "mesh_name", ""))
        with self.lock:
            sinks = list(self.sinks.items())
        for prefix, sink in sinks:
            if name.startswith(prefix):
                sink(name[len(prefix) :].split("-", 1)[0], failure)
                return
        if name.startswith(("composer_", "logger-", "setup-")):
            return
        if self.previous is not None:
            self.previous(failure)

    def register(self, prefix: str, sink: Callable[[str, Any], None]) -> None:
        with self.lock:
            if monarch_actor.unhandled_fault_hook is not self:
                self.previous = monarch_actor.unhandled_fault_hook
                monarch_actor.unhandled_fault_hook = self
            self.sinks[prefix] = sink

    def unregister(self, prefix: str) -> None:
        with self.lock:
            self.sinks.pop(prefix, None)


FAULTS = _FaultRouter()
