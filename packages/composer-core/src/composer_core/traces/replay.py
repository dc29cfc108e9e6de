"""N-teacher replay: ask OpenAI-compatible chat-completions endpoints for the next action.

For each student state (the messages before one of the student's assistant turns) every
configured teacher is asked ``POST {base_url}/chat/completions``. Any OpenAI-compatible
server works: a hosted router, vLLM, SGLang, a local server.

Guarantees:

- **Bounded concurrency**: at most ``max_concurrency`` requests in flight overall and
  ``TeacherConfig.max_concurrency`` per teacher.
- **Retries**: 408/409/429, 5xx, timeouts, connection errors, malformed JSON and responses
  without ``choices[0].message`` are retried up to ``max_retries`` times with exponential
  backoff and jitter: sleep ~ U(d/2, d), ``d = min(backoff_max_s, backoff_base_s·2^attempt)``;
  a ``Retry-After`` header (seconds) is honoured up to ``backoff_max_s``. Other 4xx are not
  retried. Every request has a timeout (``timeout_s``).
- **Failures are recorded, never dropped**: a request that finally fails yields a
  :class:`ReplayResult` with ``failure`` set to the reason.
- **Cache**: every answer is written (atomically) to ``cache_dir`` as soon as it arrives,
  keyed by SHA-256 over (teacher name, model, state hash, sampling parameters); a rerun —
  also after a crash or ``kill -9`` — reads it and never pays for it again. Identical
  requests within one run are sent once. Requests that got no answer are not cached (a
  rerun retries them); an answer that arrived but is unusable (e.g. empty) is cached and
  reported as a failure.
- **Accounting** per teacher (:class:`TeacherStats`): HTTP requests, cache hits, retries,
  failures, prompt/completion tokens (from ``usage``) and cost from the configured prices.
- **Keys**: read from the environment variable named by ``api_key_env`` at request time;
  never stored in configs, caches, results, logs or errors (``teachers.toml`` refuses an
  ``api_key`` entry).

Requires the ``replay`` extra (``pip install 'composer-core[replay]'``, httpx).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib
import json
import logging
import math
import os
import random
import tempfile
import tomllib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .schema import Message, canonical_json, message_from_dict, state_hash

__all__ = [
    "ReplayCache",
    "ReplayJob",
    "ReplayResult",
    "Replayer",
    "TeacherConfig",
    "TeacherStats",
    "load_teachers",
]

log = logging.getLogger(__name__)


def _httpx() -> Any:
    try:
        return importlib.import_module("httpx")
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "teacher replay needs httpx: install the replay extra, pip install 'composer-core[replay]'"
        ) from e


@dataclass(frozen=True)
class TeacherConfig:
    """One teacher endpoint (a ``[[teachers]]`` table of ``teachers.toml``).

    ``base_url`` ends before ``/chat/completions`` (e.g. ``http://127.0.0.1:8000/v1``).
    Prices are USD per million tokens. ``extra_body`` is merged into every request body.
    """

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
        for attr in (
            "input_cost_per_mtok",
            "output_cost_per_mtok",
            "timeout_s",
            "backoff_base_s",
            "backoff_max_s",
        ):
            v = getattr(self, attr)
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"teacher {self.name!r}: {attr} must be a finite number >= 0, got {v!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"teacher {self.name!r}: timeout_s must be > 0")
        if not isinstance(self.max_concurrency, int) or self.max_concurrency < 1:
            raise ValueError(f"teacher {self.name!r}: max_concurrency must be an integer >= 1")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"teacher {self.name!r}: max_retries must be an integer >= 0")

    def api_key(self) -> str | None:
        """The key from ``os.environ[api_key_env]`` (None when no variable is configured)."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"teacher {self.name!r}: environment variable {self.api_key_env} is not set")
        return key

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (
            prompt_tokens * self.input_cost_per_mtok + completion_tokens * self.output_cost_per_mtok
        ) / 1e6


_TEACHER_FIELDS = {f.name for f in dataclasses.fields(TeacherConfig)}


def load_teachers(path: str | Path) -> list[TeacherConfig]:
    """Parse ``teachers.toml``: an optional ``[defaults]`` table and ``[[teachers]]`` tables.

    Example::

        [defaults]
        timeout_s = 60
        max_retries = 4

        [[teachers]]
        name = "big"
        base_url = "https://openrouter.ai/api/v1"
        model = "qwen/qwen3-coder"
        api_key_env = "OPENROUTER_API_KEY"
        input_cost_per_mtok = 0.2
        output_cost_per_mtok = 0.8
    """
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
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{p}: teacher names must be unique, got {names}")
    return out


@dataclass
class TeacherStats:
    """Per-teacher accounting of one :class:`Replayer` (tokens and cost: paid requests only)."""

    requests: int = 0  # HTTP requests sent (retries included)
    answers: int = 0  # answers received and cached this run
    cache_hits: int = 0
    retries: int = 0
    failures: int = 0
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
    """A teacher's answer (``message``) or the reason it finally failed (``failure``)."""

    teacher: str
    model: str
    key: str
    message: Message | None
    failure: str | None
    cached: bool
    attempts: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0

    @property
    def ok(self) -> bool:
        return self.message is not None


class ReplayCache:
    """On-disk cache: one JSON file per key under ``root/<teacher>/<key[:2]>/<key>.json``.

    Writes go to a temporary file then ``os.replace``, so a killed process leaves either
    a complete entry or none.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def key(
        teacher: TeacherConfig, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] = ()
    ) -> str:
        """SHA-256 of (teacher name, model, state hash, sampling parameters)."""
        params = {
            "temperature": teacher.temperature,
            "max_tokens": teacher.max_tokens,
            "extra": dict(teacher.extra_body),
        }
        payload = [teacher.name, teacher.model, state_hash(messages, tools), params]
        return hashlib.sha256(canonical_json(payload).encode()).hexdigest()

    def _path(self, teacher: str, key: str) -> Path:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in teacher)
        return self.root / safe / key[:2] / f"{key}.json"

    def get(self, teacher: str, key: str) -> dict[str, Any] | None:
        p = self._path(teacher, key)
        try:
            entry = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"corrupt cache entry {p}: {e}; delete it to re-request") from e
        if not isinstance(entry, dict) or entry.get("key") != key:
            raise ValueError(f"corrupt cache entry {p}: key mismatch; delete it to re-request")
        return entry

    def put(self, teacher: str, key: str, entry: Mapping[str, Any]) -> None:
        p = self._path(teacher, key)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({**entry, "key": key}, f, ensure_ascii=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class _Fatal(Exception):
    pass


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("retry-after")
    try:
        return None if value is None else max(0.0, float(value))
    except ValueError:
        return None


class Replayer:
    """Ask N teachers for actions with bounded concurrency, retries, caching and accounting.

    ``sleep`` and ``rng`` are injectable (tests use them to check the backoff schedule);
    ``transport`` is passed to ``httpx.AsyncClient``.
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
    ) -> None:
        if not teachers:
            raise ValueError("teachers is empty: configure at least one teacher")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self.teachers = {t.name: t for t in teachers}
        if len(self.teachers) != len(teachers):
            raise ValueError("teacher names must be unique")
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

    def _redact(self, text: str) -> str:
        for t in self.teachers.values():
            if t.api_key_env and os.environ.get(t.api_key_env):
                text = text.replace(os.environ[t.api_key_env], "***")
        return text

    def backoff(self, teacher: TeacherConfig, attempt: int, retry_after: float | None) -> float:
        """Sleep before retry ``attempt`` (0-based): U(d/2, d), d = min(max, base·2^attempt)."""
        d = min(teacher.backoff_max_s, teacher.backoff_base_s * 2**attempt)
        delay = self._rng.uniform(d / 2, d)
        if retry_after is not None:
            delay = max(delay, min(retry_after, teacher.backoff_max_s))
        return delay

    async def _post(self, client: Any, t: TeacherConfig, body: Mapping[str, Any]) -> dict[str, Any]:
        httpx = _httpx()
        headers = {"Content-Type": "application/json"}
        key = t.api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        url = t.base_url.rstrip("/") + "/chat/completions"
        try:  # httpx's timeout is per phase; wait_for makes timeout_s a deadline for the whole request
            resp = await asyncio.wait_for(
                client.post(url, json=body, headers=headers, timeout=httpx.Timeout(t.timeout_s)), t.timeout_s
            )
        except (TimeoutError, httpx.TimeoutException) as e:
            raise _Retryable(f"timeout after {t.timeout_s:g}s ({type(e).__name__})") from e
        except httpx.TransportError as e:
            raise _Retryable(f"connection error ({type(e).__name__})") from e
        if resp.status_code in (408, 409, 429) or resp.status_code >= 500:
            raise _Retryable(f"http {resp.status_code}", _retry_after(resp.headers))
        if resp.status_code >= 400:
            raise _Fatal(f"http {resp.status_code}: {resp.text[:300]}")
        try:
            data = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _Retryable(f"malformed JSON in response ({resp.text[:80]!r})") from e
        try:
            message = data["choices"][0]["message"]
            if not isinstance(message, dict):
                raise TypeError
        except (KeyError, IndexError, TypeError) as e:
            raise _Retryable("malformed response: no choices[0].message") from e
        return dict(data)

    async def _request(self, client: Any, t: TeacherConfig, job: ReplayJob, key: str) -> ReplayResult:
        st = self.stats[t.name]
        body: dict[str, Any] = {"model": t.model, "messages": [m.to_api_dict() for m in job.messages]}
        if job.tools:
            body["tools"] = [dict(x) for x in job.tools]
        if t.temperature is not None:
            body["temperature"] = t.temperature
        if t.max_tokens is not None:
            body["max_tokens"] = t.max_tokens
        body.update(t.extra_body)
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
                reason = e.reason
                if attempt < t.max_retries:
                    st.retries += 1
                    delay = self.backoff(t, attempt, e.retry_after)
                    log.debug("teacher %s: %s; retry %d in %.2fs", t.name, reason, attempt + 1, delay)
                    await self._sleep(delay)
                continue
            usage = data.get("usage") or {}
            pt, ct = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
            cost = t.cost(pt, ct)
            st.answers += 1
            st.prompt_tokens += pt
            st.completion_tokens += ct
            st.cost_usd += cost
            raw = {**data["choices"][0]["message"], "role": "assistant"}
            entry = {
                "teacher": t.name,
                "model": t.model,
                "message": raw,
                "usage": {"prompt_tokens": pt, "completion_tokens": ct},
            }
            if self.cache is not None:  # paid for: cached even when unusable, so a rerun does not pay again
                self.cache.put(t.name, key, entry)
            result = self._from_entry(t, key, entry, cached=False, attempts=attempts)
            if not result.ok:
                st.failures += 1
            return result
        st.failures += 1
        reason = self._redact(f"{reason} (after {attempts} attempt{'s' if attempts > 1 else ''})")
        log.warning("teacher %s failed: %s", t.name, reason)
        return ReplayResult(t.name, t.model, key, None, reason, False, attempts)

    def _from_entry(
        self, t: TeacherConfig, key: str, entry: Mapping[str, Any], cached: bool, attempts: int
    ) -> ReplayResult:
        usage = entry.get("usage") or {}
        pt, ct = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        try:
            msg: Message | None = message_from_dict(entry["message"], f"teacher {t.name} answer")
            failure = None
        except ValueError as e:
            msg, failure = None, f"unusable answer: {e}"
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

            async def run(job: ReplayJob) -> ReplayResult:
                t = self.teachers[job.teacher]
                key = ReplayCache.key(t, job.messages, job.tools)
                if key in inflight:  # identical request in this run: share it
                    result = await asyncio.shield(inflight[key])
                    if result.ok:  # a shared failure is not a cache hit
                        self.stats[t.name].cache_hits += 1
                        result = dataclasses.replace(result, cached=True)
                else:
                    fut: asyncio.Future[ReplayResult] = asyncio.get_running_loop().create_future()
                    inflight[key] = fut
                    try:
                        entry = self.cache.get(t.name, key) if self.cache is not None else None
                        if entry is not None:
                            self.stats[t.name].cache_hits += 1
                            result = self._from_entry(t, key, entry, cached=True, attempts=0)
                        else:
                            async with overall, per[t.name]:
                                result = await self._request(client, t, job, key)
                        fut.set_result(result)
                    except BaseException as e:
                        fut.set_exception(e)
                        raise
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
