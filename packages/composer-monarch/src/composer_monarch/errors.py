"""Errors the driver raises when an actor fails, and the bounded wait that produces them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from monarch.actor import ActorError, Future

R = TypeVar("R")


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
    future: Future[R],
    *,
    role: str,
    endpoint: str,
    timeout_s: float,
    failures: Callable[[], list[Any]],
    poll_s: float = 0.2,
) -> R:
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
                raise ActorCrashedError(role, endpoint, f"a process of the mesh failed: {seen[0]}") from None
        except ActorError as e:
            raise ActorCrashedError(role, endpoint, str(e).strip(), e.exception) from e
        except Exception as e:  # supervision errors and other runtime failures from Monarch
            raise ActorCrashedError(role, endpoint, f"{type(e).__name__}: {e}") from e
