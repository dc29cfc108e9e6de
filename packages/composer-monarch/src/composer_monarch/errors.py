"""Errors the driver raises when an actor fails, and the bounded wait that produces them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import monarch.actor as monarch_actor
from monarch.actor import ActorError, Future


class ActorCrashedError(RuntimeError):
    """An actor raised, or its process died, while the driver waited on an actor.

    ``role``: the role that failed (the waited-on role ``waiting_on`` if its process died, else the first
    one Monarch reported); ``roles``: every role of the dead process; ``remote_exception``: the actor's
    exception when it raised.
    """

    def __init__(
        self,
        role: str,
        endpoint: str,
        detail: str,
        remote_exception: BaseException | None = None,
        *,
        waiting_on: str | None = None,
        roles: tuple[str, ...] | None = None,
    ):
        self.role = role
        self.endpoint = endpoint
        self.waiting_on = role if waiting_on is None else waiting_on
        self.roles = (role,) if roles is None else roles
        self.remote_exception = remote_exception
        where = f"in {endpoint!r}"
        if self.waiting_on != role:
            where = f"while the driver waited on the {self.waiting_on} actor's {endpoint!r}"
        super().__init__(f"composer-monarch: the {role} actor failed {where}: {detail}")


class ActorTimeoutError(TimeoutError):
    """An actor did not answer within the driver's ``call_timeout_s`` of the call being sent."""

    def __init__(self, role: str, endpoint: str, timeout_s: float):
        self.role = role
        self.endpoint = endpoint
        super().__init__(
            f"composer-monarch: the {role} actor did not answer {endpoint!r} within {timeout_s:.0f} s "
            "(raise LoopConfig.call_timeout_s if the step is legitimately slower)"
        )


@dataclass(frozen=True)
class ProcessFailure:
    """A failure Monarch's supervision reported for one of a driver's actor meshes."""

    role: str  # the role whose actor mesh failed
    roles: tuple[str, ...]  # every role the failed process hosts
    detail: str


@dataclass(eq=False)
class Call:
    """An endpoint call in flight: its future, who answers it and its deadline (from the send)."""

    future: Future[Any]
    role: str
    endpoint: str
    timeout_s: float
    sent_at: float = field(default_factory=time.monotonic)
    outcome: tuple[bool, Any] | None = None  # (answered normally, value or exception)

    @property
    def deadline(self) -> float:
        return self.sent_at + self.timeout_s

    def poll(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the answer; True once it (a value or an error) is in."""
        if self.outcome is None:
            try:
                self.outcome = (True, self.future.get(timeout=max(timeout_s, 0.0)))
            except TimeoutError:
                return False
            except Exception as e:  # the actor raised, or Monarch reports its mesh failed
                self.outcome = (False, e)
        return True


def wait(
    call: Call,
    *,
    failures: Callable[[], list[ProcessFailure]],
    others: Callable[[], list[Call]] = list,
    poll_s: float = 0.2,
) -> Any:
    """The answer to ``call``, polled in slices of ``poll_s`` seconds, bounded by its deadline.

    Between slices it checks ``failures()`` (processes Monarch's supervision reported dead) and the
    deadlines of ``others()``, the driver's other calls in flight (in overlap mode the ``train_step``
    must answer in time while the driver waits on the next rollout). Failures and exceptions raised in
    the actor become :class:`ActorCrashedError`; missed deadlines :class:`ActorTimeoutError`.
    """
    while not call.poll(min(poll_s, call.deadline - time.monotonic())):
        if seen := failures():
            own = [f for f in seen if call.role in f.roles]
            f = own[0] if own else seen[0]
            role, detail = (call.role if own else f.role), f"while waiting on it, {f.detail}"
            raise ActorCrashedError(
                role, call.endpoint, detail, waiting_on=call.role, roles=f.roles
            ) from None
        now = time.monotonic()
        for other in others():
            if other is not call and now >= other.deadline and not other.poll(0.0):
                raise ActorTimeoutError(other.role, other.endpoint, other.timeout_s)
        if now >= call.deadline:
            raise ActorTimeoutError(call.role, call.endpoint, call.timeout_s)
    assert call.outcome is not None
    ok, value = call.outcome
    if ok:
        return value
    if isinstance(value, ActorError):
        raise ActorCrashedError(call.role, call.endpoint, str(value).strip(), value.exception) from value
    # supervision errors and other runtime failures from Monarch
    raise ActorCrashedError(call.role, call.endpoint, f"{type(value).__name__}: {value}") from value


class _FaultRouter:
    """Monarch's ``unhandled_fault_hook`` (whose default exits the client) while composer drivers exist.

    Failures of a driver's actor meshes (``composer_<token>_<role>``) go to that driver; late reports about
    stopped drivers' meshes and proc meshes' internal ``logger``/``setup`` actors (they fail with the named
    actors on their process) are dropped; anything else goes to the previous hook. Once set it stays.
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
