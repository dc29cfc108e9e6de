"""A deterministic OpenAI-compatible chat-completions server (stdlib, real HTTP on ``127.0.0.1``) for tests.

It answers ``POST .../chat/completions`` with a pure function of (model, messages): by default
``"answer <hash of the messages>"``, so teacher models agree unless ``answer_fn`` says otherwise.
``faults`` (per model, consumed one request at a time; the last repeats if ``repeat_last``): ``"ok"``,
``"429"`` (``Retry-After``), ``"500"``, ``"503"``, ``"400"`` (echoes the request's ``Authorization`` header,
as some gateways do), ``"timeout"`` (sleeps ``timeout_sleep_s``), ``"malformed"`` (HTTP 200, not JSON),
``"no_choices"``; the hostile ones put ``echo_pad`` characters then the ``Authorization`` header (raw,
URL-encoded, base64) in the body: ``"401"``, ``"500_echo"``, ``"malformed_echo"``, ``"answer_echo"`` (a valid
answer holding it), ``"oversize"`` / ``"oversize_chunked"`` (``oversize_bytes`` with / without a length); and
the malformed-but-JSON answers of :data:`BAD_PAYLOADS`. Counters: ``requests`` / ``answered`` per (model,
state hash), ``total_requests``, ``max_in_flight``. ``on_request(n, model, state)`` runs before the n-th
request; when it returns True the connection is closed without an answer.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["BAD_PAYLOADS", "ChatServer", "default_answer"]

AnswerFn = Callable[[str, list[dict[str, Any]]], dict[str, Any]]


def _state(messages: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(payload: dict[str, Any]) -> Any:
        target: Any = payload
        for k in path[:-1]:
            target = target[k]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return payload

    return edit


_DELETE = object()
_INF = "__INF__"  # serialised as the JSON number 1e999 (Python's json reads it as inf)

#: fault name -> how it damages a valid payload (a JSON-serialisable value is returned)
BAD_PAYLOADS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "usage_str": _set(("usage", "prompt_tokens"), "abc"),
    "usage_inf": _set(("usage", "prompt_tokens"), _INF),
    "usage_missing": _set(("usage",), _DELETE),
    "usage_not_dict": _set(("usage",), [1, 2]),
    "usage_negative": _set(("usage", "completion_tokens"), -5),
    "usage_huge": _set(("usage", "prompt_tokens"), 10**400),
    "choices_empty": _set(("choices",), []),
    "choices_not_list": _set(("choices",), {"0": 1}),
    "choice_not_dict": _set(("choices", 0), "text"),
    "message_not_dict": _set(("choices", 0, "message"), ["assistant"]),
    "content_not_str": _set(("choices", 0, "message", "content"), {"text": 1}),
    "tool_calls_not_list": _set(("choices", 0, "message", "tool_calls"), 5),
    "role_wrong": _set(("choices", 0, "message", "role"), 7),
    "role_system": _set(("choices", 0, "message", "role"), "system"),
    "not_object": lambda payload: [payload],
}


def _dumps(value: Any) -> bytes:
    return json.dumps(value).replace(f'"{_INF}"', "1e999").encode()


def _echo_forms(auth: str | None) -> str:
    """The ``Authorization`` header as a leaky gateway might echo it: raw, URL-encoded, base64."""
    a = auth or ""
    b64 = base64.b64encode(a.encode()).decode()
    return f"Authorization: {a} url={urllib.parse.quote(a, safe='')} b64={b64}"


def default_answer(model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"role": "assistant", "content": "answer <first 12 hex of the state hash>"}``."""
    return {"role": "assistant", "content": f"answer {_state(messages)[:12]}"}


@dataclass(eq=False)
class ChatServer:
    """Run with ``with ChatServer() as srv: srv.base_url`` (``http://127.0.0.1:<port>/v1``)."""

    answer_fn: AnswerFn = default_answer
    _: KW_ONLY
    faults: dict[str, list[str]] = field(default_factory=dict)
    repeat_last: bool = False
    timeout_sleep_s: float = 2.0
    require_key: str | None = None
    on_request: Callable[[int, str, str], bool | None] | None = None
    retry_after: str = "0"
    echo_pad: int | dict[str, int] = 0
    oversize_bytes: int = 60_000_000
    oversize_sent: int = field(default=0, init=False)  # bytes written before the client hung up
    in_flight: int = field(default=0, init=False)
    max_in_flight: int = field(default=0, init=False)
    requests: Counter[tuple[str, str]] = field(default_factory=Counter, init=False)
    answered: Counter[tuple[str, str]] = field(default_factory=Counter, init=False)
    total_requests: int = field(default=0, init=False)
    bodies: list[dict[str, Any]] = field(default_factory=list, init=False)
    auth_headers: list[str | None] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.faults = {k: list(v) for k, v in self.faults.items()}  # consumed: the caller's lists stay
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def base_url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("server not started")
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def _next_fault(self, model: str) -> str:
        plan = self.faults.get(model)
        if not plan:
            return "ok"
        if len(plan) == 1 and self.repeat_last:
            return plan[0]
        return plan.pop(0)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        return type("Handler", (_Handler,), {"chat": self})

    def start(self) -> ChatServer:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> ChatServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    """The OpenAI-compatible chat endpoint of :class:`ChatServer` (``chat``: the server whose plan it follows)."""

    chat: ChatServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # silence (and never log headers)
        return

    def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length))
            model, messages = str(body["model"]), list(body["messages"])
        except (ValueError, KeyError, TypeError):
            self._send(400, b'{"error": {"message": "bad request"}}')
            return
        if not self.path.endswith("/chat/completions"):
            self._send(404, b'{"error": {"message": "not found"}}')
            return
        state = _state(messages)
        with self.chat._lock:
            self.chat.total_requests += 1
            n = self.chat.total_requests
            self.chat.requests[(model, state)] += 1
            self.chat.bodies.append(body)
            self.chat.auth_headers.append(self.headers.get("Authorization"))
            fault = self.chat._next_fault(model)
            self.chat.in_flight += 1
            self.chat.max_in_flight = max(self.chat.max_in_flight, self.chat.in_flight)
        try:
            self._answer(n, model, messages, state, fault)
        finally:
            with self.chat._lock:
                self.chat.in_flight -= 1

    def _answer(self, n: int, model: str, messages: list[dict[str, Any]], state: str, fault: str) -> None:
        if self.chat.on_request is not None and self.chat.on_request(n, model, state):
            self.close_connection = True
            return
        if (
            self.chat.require_key is not None
            and self.headers.get("Authorization") != f"Bearer {self.chat.require_key}"
        ):
            self._send(401, b'{"error": {"message": "invalid api key"}}')
            return
        if self._error_fault(fault) or self._hostile(fault, model):
            return
        if fault == "timeout":
            time.sleep(self.chat.timeout_sleep_s)
        message = self.chat.answer_fn(model, messages)
        if fault == "answer_echo":
            message = {
                "role": "assistant",
                "content": "ok " + _echo_forms(self.headers.get("Authorization")),
            }
        prompt_chars = sum(len(str(m.get("content") or "")) for m in messages)
        completion_chars = len(json.dumps(message))
        payload = {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion",
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": 1 + prompt_chars // 4,
                "completion_tokens": 1 + completion_chars // 4,
                "total_tokens": 2 + prompt_chars // 4 + completion_chars // 4,
            },
        }
        damage = BAD_PAYLOADS.get(fault)
        try:
            self._send(200, _dumps(damage(payload) if damage else payload))
        except OSError:  # client gone (killed): not answered
            return
        if fault != "timeout":
            with self.chat._lock:
                self.chat.answered[(model, state)] += 1

    def _error_fault(self, fault: str) -> bool:
        """Answer the error-status and broken-body faults; False when ``fault`` is not one of them."""
        if fault == "400":
            echo = json.dumps({"error": {"message": f"bad auth {self.headers.get('Authorization')}"}})
            self._send(400, echo.encode())
        elif fault in ("429", "500", "503"):
            extra = {"Retry-After": self.chat.retry_after} if fault == "429" else None
            self._send(int(fault), b'{"error": {"message": "injected"}}', extra)
        elif fault == "malformed":
            self._send(200, b'{"choices": [ this is not json')
        elif fault == "no_choices":
            self._send(200, b'{"object": "chat.completion"}')
        else:
            return False
        return True

    def _hostile(self, fault: str, model: str) -> bool:
        """Answer the echo/oversize faults; False when ``fault`` is not one of them."""
        pad = self.chat.echo_pad if isinstance(self.chat.echo_pad, int) else self.chat.echo_pad.get(model, 0)
        echo = "x" * pad + _echo_forms(self.headers.get("Authorization"))
        if fault in ("401", "500_echo"):
            body = json.dumps({"error": {"message": echo}}).encode()
            self._send(401 if fault == "401" else 500, body)
        elif fault == "malformed_echo":
            self._send(200, ("<html>" + echo + "</html>").encode())
        elif fault in ("oversize", "oversize_chunked"):
            self._stream_oversize(echo.encode(), chunked=fault == "oversize_chunked")
        else:
            return False
        return True

    def _stream_oversize(self, head: bytes, chunked: bool) -> None:
        total, block = self.chat.oversize_bytes, b"y" * 65536
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(total))
        self.end_headers()
        sent = 0
        try:
            while sent < total:
                part = (head if sent == 0 else block)[: total - sent]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                sent += len(part)
                with self.chat._lock:
                    self.chat.oversize_sent += len(part)
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client stopped reading and hung up: the point of the test
            self.close_connection = True
