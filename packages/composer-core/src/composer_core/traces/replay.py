"""N-teacher replay: ask OpenAI-compatible chat-completions endpoints for the next action.

:class:`Replayer` asks every configured teacher ``POST {base_url}/chat/completions`` at each student state; its
guarantees (concurrency, deadlines, retries, the cache, accounting, redaction) are the package README's "Traces,
hints and teacher replay" and "Reliability". Requires the ``replay`` extra (httpx).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import tomllib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_core.loss.validation import check_int

from .redact import redact, redact_strings
from .replay_cache import ReplayCache
from .schema import Message, canonical_json, import_extra, message_from_dict, state_hash

__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "ReplayCache",
    "ReplayJob",
    "ReplayResult",
    "Replayer",
    "TeacherConfig",
    "TeacherStats",
    "load_teachers",
    "redact",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_RESPONSE_BYTES = 8 * 2**20
ERROR_BODY_BYTES = 64 * 2**10  # how much of an error body is read (redacted, then cut to 300 chars)
_MAX_COUNT = 10**15


def _count(value: Any) -> int | None:
    """A ``usage`` token count, or None (unknown) when missing, non-numeric, negative or absurd."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if 0 <= value < _MAX_COUNT else None


def _usage(data: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(prompt, completion) token counts of a response's or cache entry's ``usage``."""
    usage = data.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    return _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))


def _httpx() -> Any:
    return import_extra("httpx", "teacher replay", "replay")


@dataclass(frozen=True)
class TeacherConfig:
    """One teacher endpoint: ``base_url`` ends before ``/chat/completions``, prices are USD per million
    tokens, ``extra_body`` is merged into every request body."""

    name: str
    base_url: str
    model: str
    api_key_env: str | None = None
    input_cost_per_mtok: float = 0.0
    output_cost_per_mtok: float = 0.0
    max_concurrency: int = 4
    timeout_s: float = 60.0
    max_retries: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    temperature: float | None = 0.0
    max_tokens: int | None = 1024
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for attr in ("name", "base_url", "model"):
            if not isinstance(getattr(self, attr), str) or not getattr(self, attr):
                raise ValueError(f"teacher {attr} must be a non-empty string")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"teacher {self.name!r}: base_url must start with http:// or https://")
        for attr in ("input_cost_per_mtok", "output_cost_per_mtok", "timeout_s", "backoff_base_s",
                     "backoff_max_s"):  # fmt: skip
            v = getattr(self, attr)
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"teacher {self.name!r}: {attr} must be a finite number >= 0, got {v!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"teacher {self.name!r}: timeout_s must be > 0")
        for attr, low in (("max_concurrency", 1), ("max_retries", 0)):
            if not isinstance(getattr(self, attr), int) or getattr(self, attr) < low:
                raise ValueError(f"teacher {self.name!r}: {attr} must be an integer >= {low}")
        if self.api_key_env is not None and (
            not isinstance(self.api_key_env, str) or not self.api_key_env.strip()
        ):
            raise ValueError(
                f"teacher {self.name!r}: api_key_env must name an environment variable, got {self.api_key_env!r}; "
                "drop api_key_env for an endpoint without a key"
            )

    def api_key(self) -> str | None:
        """The key from ``os.environ[api_key_env]`` (None when no variable is configured)."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env, "")
        if not key.strip():
            raise ValueError(
                f"teacher {self.name!r}: environment variable {self.api_key_env} is not set or blank; "
                f"export {self.api_key_env}=... or drop api_key_env for an endpoint without a key"
            )
        return key

    def cache_key(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] = ()) -> str:
        """The :class:`ReplayCache` key of a request: SHA-256 of (name, model, state hash, sampling parameters)."""
        params = {
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "extra": dict(self.extra_body),
        }
        payload = [self.name, self.model, state_hash(messages, tools), params]
        return hashlib.sha256(canonical_json(payload).encode()).hexdigest()

    def cost(self, prompt_tokens: int | None, completion_tokens: int | None) -> float | None:
        """USD for one answer; None when a count is unknown."""
        if prompt_tokens is None or completion_tokens is None:
            return None
        return (
            prompt_tokens * self.input_cost_per_mtok + completion_tokens * self.output_cost_per_mtok
        ) / 1e6


_TEACHER_FIELDS = {f.name for f in dataclasses.fields(TeacherConfig)}


def load_teachers(path: str | Path) -> list[TeacherConfig]:
    """Parse ``teachers.toml``: an optional ``[defaults]`` table and ``[[teachers]]`` tables whose keys are
    :class:`TeacherConfig` fields (example in the package README)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{p}: invalid TOML ({e})") from e
    unknown_top = set(data) - {"defaults", "teachers"}
    if unknown_top:
        raise ValueError(
            f"{p}: unknown top-level keys {sorted(unknown_top)} (expected [defaults] and [[teachers]])"
        )
    defaults = data.get("defaults", {})
    tables = data.get("teachers", [])
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"{p}: define at least one [[teachers]] table")
    out: list[TeacherConfig] = []
    for i, table in enumerate(tables):
        merged = {**defaults, **table}
        if "api_key" in merged:
            raise ValueError(
                f"{p}: teachers[{i}] contains api_key; never put keys in files — set "
                "api_key_env = 'VARIABLE_NAME' and export the key in that variable"
            )
        unknown = set(merged) - _TEACHER_FIELDS
        if unknown:
            raise ValueError(
                f"{p}: teachers[{i}] has unknown keys {sorted(unknown)}; allowed: {sorted(_TEACHER_FIELDS)}"
            )
        try:
            out.append(TeacherConfig(**merged))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{p}: teachers[{i}]: {e}") from e
    return out


@dataclass
class TeacherStats:
    """Per-teacher accounting of one :class:`Replayer` (tokens and cost: paid requests only)."""

    requests: int = 0  # HTTP requests sent (retries included)
    answers: int = 0  # answers received and cached this run
    cache_hits: int = 0
    retries: int = 0
    failures: int = 0
    usage_unknown: int = 0  # answers with a missing / non-numeric usage count (not in the totals)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0


@dataclass(frozen=True)
class ReplayJob:
    """Ask ``teacher`` for the next action at state ``messages``."""

    teacher: str
    messages: tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class ReplayResult:
    """A teacher's answer (``message``) or the reason it finally failed (``failure``); token counts and
    cost are None when ``usage`` did not state them usably."""

    teacher: str
    model: str
    key: str
    message: Message | None
    failure: str | None
    cached: bool
    attempts: int
    prompt_tokens: int | None = 0
    completion_tokens: int | None = 0
    cost_usd: float | None = 0.0

    @property
    def ok(self) -> bool:
        return self.message is not None


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class _Fatal(Exception):
    pass


def _answer_message(data: Any) -> dict[str, Any]:
    """``choices[0].message`` of a chat-completions payload; :class:`_Retryable` naming what is wrong."""
    if not isinstance(data, dict):
        raise _Retryable(f"malformed response: the body is a JSON {type(data).__name__}, not an object")
    choices = data.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    message = first.get("message") if isinstance(first, dict) else None
    if not isinstance(message, dict):
        raise _Retryable(
            f"malformed response: no choices[0].message object (choices is {type(choices).__name__})"
        )
    return message


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("retry-after")
    try:
        return None if value is None else max(0.0, float(value))
    except ValueError:
        return None


class Replayer:
    """Ask N teachers for actions with bounded concurrency, retries, caching and accounting.

    ``sleep`` and ``rng`` drive the backoff; ``transport`` is passed to ``httpx.AsyncClient``.
    """

    def __init__(
        self,
        teachers: Sequence[TeacherConfig],
        cache_dir: str | Path | None = None,
        *,
        max_concurrency: int = 16,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        transport: Any = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        if not teachers:
            raise ValueError("teachers is empty: configure at least one teacher")
        check_int("max_concurrency", max_concurrency, low=1)
        check_int("max_response_bytes", max_response_bytes, low=1)
        self.max_response_bytes = max_response_bytes
        self.teachers = {t.name: t for t in teachers}
        if len(self.teachers) != len(teachers):
            raise ValueError(f"teacher names must be unique, got {[t.name for t in teachers]}")
        self.cache = None if cache_dir is None else ReplayCache(cache_dir)
        self.max_concurrency = max_concurrency
        self.stats = {t.name: TeacherStats() for t in teachers}
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._transport = transport
        _httpx()  # fail early with the extra's name

    @property
    def teacher_names(self) -> list[str]:
        return list(self.teachers)

    def _secrets(self) -> list[str]:
        return [k for t in self.teachers.values() if t.api_key_env and (k := os.environ.get(t.api_key_env))]

    def _redact(self, text: str) -> str:
        return redact(text, self._secrets())

    def backoff(self, teacher: TeacherConfig, attempt: int, retry_after: float | None) -> float:
        """Sleep before retry ``attempt`` (0-based): U(d/2, d), d = min(max, base·2^attempt)."""
        d = min(teacher.backoff_max_s, teacher.backoff_base_s * 2**attempt)
        delay = self._rng.uniform(d / 2, d)
        if retry_after is not None:
            delay = max(delay, min(retry_after, teacher.backoff_max_s))
        return delay

    async def _read(
        self, client: Any, url: str, body: Mapping[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, Mapping[str, str], bytes, bool]:
        """POST and read the body streamed: (status, headers, body, oversize). Never reads past the cap."""
        httpx = _httpx()
        async with client.stream(
            "POST", url, json=body, headers=headers, timeout=httpx.Timeout(timeout_s)
        ) as resp:
            cap = self.max_response_bytes if resp.status_code < 400 else ERROR_BODY_BYTES
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_response_bytes:
                return resp.status_code, resp.headers, b"", True
            buf = bytearray()
            async for chunk in resp.aiter_bytes():
                buf += chunk
                if len(buf) > cap:
                    return resp.status_code, resp.headers, bytes(buf[:cap]), cap == self.max_response_bytes
            return resp.status_code, resp.headers, bytes(buf), False

    def _snippet(self, raw: bytes, limit: int) -> str:
        """Redact first, then cut (a key cut at the edge would no longer match)."""
        return self._redact(raw.decode("utf-8", errors="replace"))[:limit]

    async def _post(self, client: Any, t: TeacherConfig, body: Mapping[str, Any]) -> dict[str, Any]:
        httpx = _httpx()
        headers = {"Content-Type": "application/json"}
        key = t.api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        url = t.base_url.rstrip("/") + "/chat/completions"
        try:  # httpx's timeout is per phase; wait_for makes timeout_s a deadline for the whole request
            status, resp_headers, raw, oversize = await asyncio.wait_for(
                self._read(client, url, body, headers, t.timeout_s), t.timeout_s
            )
        except (TimeoutError, httpx.TimeoutException) as e:
            raise _Retryable(f"timeout after {t.timeout_s:g}s ({type(e).__name__})") from e
        except httpx.TransportError as e:
            raise _Retryable(f"connection error ({type(e).__name__})") from e
        if status in (408, 409, 429) or status >= 500:
            raise _Retryable(f"http {status}", _retry_after(resp_headers))
        if status >= 400:
            raise _Fatal(f"http {status}: {self._snippet(raw, 300)}")
        if oversize:
            raise _Fatal(
                f"response larger than max_response_bytes={self.max_response_bytes} "
                "(raise --max-response-bytes if the endpoint really answers that much)"
            )
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _Retryable(f"malformed JSON in response ({self._snippet(raw, 80)!r})") from e
        _answer_message(data)
        return dict(data)

    async def _request(self, client: Any, t: TeacherConfig, job: ReplayJob, key: str) -> ReplayResult:
        st = self.stats[t.name]
        tools = [dict(x) for x in job.tools] or None
        optional = {"tools": tools, "temperature": t.temperature, "max_tokens": t.max_tokens}
        body = {"model": t.model, "messages": [m.to_api_dict() for m in job.messages]}
        body |= {k: v for k, v in optional.items() if v is not None} | dict(t.extra_body)
        reason = ""
        attempts = 0
        for attempt in range(t.max_retries + 1):
            attempts = attempt + 1
            st.requests += 1
            try:
                data = await self._post(client, t, body)
            except _Fatal as e:
                reason = str(e)
                break
            except _Retryable as e:
                reason = str(e)
                if attempt < t.max_retries:
                    st.retries += 1
                    delay = self.backoff(t, attempt, e.retry_after)
                    log.debug("teacher %s: %s; retry %d in %.2fs", t.name, reason, attempt + 1, delay)
                    await self._sleep(delay)
                continue
            except Exception as e:  # anything else a hostile endpoint provokes fails this request only
                reason = f"unexpected {type(e).__name__} reading the response: {self._redact(str(e))[:300]}"
                break
            return self._answered(t, key, data, attempts)
        st.failures += 1
        reason = self._redact(f"{reason} (after {attempts} attempt{'s' if attempts > 1 else ''})")
        log.warning("teacher %s failed: %s", t.name, reason)
        return ReplayResult(t.name, t.model, key, None, reason, False, attempts)

    def _answered(self, t: TeacherConfig, key: str, data: Mapping[str, Any], attempts: int) -> ReplayResult:
        """Account and cache a paid answer (even an unusable one, so a rerun does not pay again)."""
        st = self.stats[t.name]
        pt, ct = _usage(data)
        st.answers += 1
        st.usage_unknown += pt is None or ct is None
        st.prompt_tokens += pt or 0
        st.completion_tokens += ct or 0
        st.cost_usd += t.cost(pt or 0, ct or 0) or 0.0
        raw = redact_strings({"role": "assistant", **_answer_message(data)}, self._secrets())
        usage = {"prompt_tokens": pt, "completion_tokens": ct}
        entry = {"teacher": t.name, "model": t.model, "message": raw, "usage": usage}
        if self.cache is not None:
            self.cache.put(t.name, key, entry)
        result = self._from_entry(t, key, entry, cached=False, attempts=attempts)
        if not result.ok:
            st.failures += 1
            log.warning("teacher %s failed: %s", t.name, result.failure)
        return result

    def _from_entry(
        self, t: TeacherConfig, key: str, entry: Mapping[str, Any], cached: bool, attempts: int
    ) -> ReplayResult:
        pt, ct = _usage(entry)
        try:
            msg: Message | None = message_from_dict(entry.get("message"), f"teacher {t.name} answer")
            if msg is not None and msg.role != "assistant":
                raise ValueError(f"teacher {t.name} answer: role {msg.role!r}, not 'assistant'")
            failure = None
        except (ValueError, TypeError, AttributeError) as e:  # any malformed part: unusable, not a crash
            msg, failure = None, self._redact(f"unusable answer: {e}")[:300]
        return ReplayResult(t.name, t.model, key, msg, failure, cached, attempts, pt, ct, t.cost(pt, ct))

    async def areplay(
        self, jobs: Sequence[ReplayJob], on_result: Callable[[ReplayResult], None] | None = None
    ) -> list[ReplayResult]:
        """Run ``jobs``; results in job order. ``on_result`` is called as each one completes."""
        for j in jobs:
            if j.teacher not in self.teachers:
                raise ValueError(f"job names unknown teacher {j.teacher!r}; configured: {self.teacher_names}")
        httpx = _httpx()
        overall = asyncio.Semaphore(self.max_concurrency)
        per = {name: asyncio.Semaphore(t.max_concurrency) for name, t in self.teachers.items()}
        inflight: dict[str, asyncio.Future[ReplayResult]] = {}
        limits = httpx.Limits(
            max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency
        )

        async with httpx.AsyncClient(transport=self._transport, limits=limits) as client:

            async def fetch(t: TeacherConfig, job: ReplayJob, key: str) -> ReplayResult:
                entry = self.cache.get(t.name, key) if self.cache is not None else None
                if entry is not None:
                    self.stats[t.name].cache_hits += 1
                    return self._from_entry(t, key, entry, cached=True, attempts=0)
                async with overall, per[t.name]:
                    return await self._request(client, t, job, key)

            async def run(job: ReplayJob) -> ReplayResult:
                t = self.teachers[job.teacher]
                key = t.cache_key(job.messages, job.tools)
                if key in inflight:  # identical request in this run: share it
                    result = await asyncio.shield(inflight[key])
                    if result.ok:  # a shared failure is not a cache hit
                        self.stats[t.name].cache_hits += 1
                        result = dataclasses.replace(result, cached=True)
                else:
                    inflight[key] = task = asyncio.ensure_future(fetch(t, job, key))
                    result = await task
                if on_result is not None:
                    on_result(result)
                return result

            return list(await asyncio.gather(*(run(j) for j in jobs)))

    def replay(
        self, jobs: Sequence[ReplayJob], on_result: Callable[[ReplayResult], None] | None = None
    ) -> list[ReplayResult]:
        """Synchronous :meth:`areplay` (must not be called from a running event loop)."""
        return asyncio.run(self.areplay(jobs, on_result))

    def complete(
        self, teacher: str, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] = ()
    ) -> ReplayResult:
        """One request (cached like any other); used by :class:`composer_core.traces.hints.TeacherHint`."""
        return self.replay([ReplayJob(teacher, tuple(messages), tuple(tools))])[0]

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per-teacher stats as plain dicts (JSON-ready; contains no keys)."""
        return {name: dataclasses.asdict(s) for name, s in self.stats.items()}
