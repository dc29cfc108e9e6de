"""Agent episodes: a typed schema in OpenAI chat format (frozen dataclasses, validated when built), ingesters
(OpenAI JSONL, Claude Code sessions) and error-site detection (package README: "Error sites, hints and masks").
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant", "tool")
ErrorKind = Literal["tool_error", "test_failure", "exit_code", "env_feedback"]

__all__ = [
    "Episode",
    "ErrorKind",
    "ErrorSite",
    "Message",
    "Role",
    "ToolCall",
    "canonical_json",
    "episode_from_dict",
    "find_error_sites",
    "message_from_dict",
    "read_claude_code_jsonl",
    "read_openai_jsonl",
    "read_traces",
    "state_hash",
    "write_openai_jsonl",
]


def import_extra(module: str, what: str, extra: str) -> Any:
    """``importlib.import_module(module)``, or an ImportError (one line) naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        need = f"the module {e.name or module} ({extra} extra)"
        raise ImportError(f"{what} needs {need}: pip install 'composer-core[{extra}]'") from e


def canonical_json(value: Any) -> str:
    """Deterministic JSON (sorted keys, no spaces, UTF-8 kept): the basis of every hash here."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ToolCall:
    """One function call of an assistant message; ``arguments`` is the JSON text the model produced (may
    be invalid JSON when the model erred)."""

    id: str
    name: str
    arguments: str = "{}"

    def __post_init__(self) -> None:
        for attr in ("id", "name", "arguments"):
            if not isinstance(getattr(self, attr), str):
                raise TypeError(f"ToolCall.{attr} must be str, got {type(getattr(self, attr)).__name__}")
        if not self.name:
            raise ValueError("ToolCall.name must be a non-empty function name")

    def parsed_arguments(self) -> Any:
        """The arguments as JSON, or the raw string when they are not valid JSON."""
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError:
            return self.arguments

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Message:
    """One chat message in OpenAI format (content-part lists are joined into ``content`` when read).

    ``is_error`` and ``exit_code`` (extensions) mark failed tool results when the harness recorded them.
    """

    role: Role
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    is_error: bool | None = None
    exit_code: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Message.role must be one of {ROLES}, got {self.role!r}")
        if self.content is not None and not isinstance(self.content, str):
            raise TypeError(
                f"Message.content must be str or None, got {type(self.content).__name__}; "
                "build messages with message_from_dict() to convert content-part lists"
            )
        if not isinstance(self.tool_calls, tuple) or not all(
            isinstance(c, ToolCall) for c in self.tool_calls
        ):
            raise TypeError("Message.tool_calls must be a tuple of ToolCall")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls (got role {self.role!r})")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")

    @property
    def text(self) -> str:
        """The content as text ('' when None)."""
        return self.content or ""

    def to_dict(self) -> dict[str, Any]:
        """OpenAI chat-completions message dict (extensions only when set)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        for attr in ("tool_call_id", "name", "is_error", "exit_code"):
            if getattr(self, attr) is not None:
                out[attr] = getattr(self, attr)
        return out

    def to_api_dict(self) -> dict[str, Any]:
        """The dict sent to a chat-completions endpoint (no composer extensions)."""
        return {k: v for k, v in self.to_dict().items() if k not in ("is_error", "exit_code")}


def _content_to_text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(part.get("text", "")))
            elif isinstance(part, Mapping) and part.get("type") in ("image_url", "image", "input_image"):
                parts.append("[image]")
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}: unsupported content part {kind!r} (text and image parts only)")
        return "".join(parts)
    raise ValueError(f"{where}: content must be a string, a list of content parts or null")


def message_from_dict(d: Any, where: str = "message") -> Message:
    """Build a :class:`Message` from an OpenAI-format dict, with errors naming ``where``."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: expected a message object, got {type(d).__name__}")
    calls: list[ToolCall] = []
    for i, c in enumerate(d.get("tool_calls") or []):
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(
                f"{where}.tool_calls[{i}]: expected {{'id', 'function': {{'name', 'arguments'}}}}"
            )
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):  # some exporters store the parsed object
            args = canonical_json(args)
        calls.append(ToolCall(id=str(c.get("id") or f"call_{i}"), name=fn["name"], arguments=args))
    exit_code = d.get("exit_code")
    if exit_code is not None and not isinstance(exit_code, int):
        raise ValueError(f"{where}: exit_code must be an integer")
    is_error = d.get("is_error")
    try:
        return Message(
            role=cast(Role, d.get("role")),  # checked by Message
            content=_content_to_text(d.get("content"), where),
            tool_calls=tuple(calls),
            tool_call_id=d.get("tool_call_id"),
            name=d.get("name"),
            is_error=None if is_error is None else bool(is_error),
            exit_code=exit_code,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


@dataclass(frozen=True)
class Episode:
    """One agent run: messages, optional tool schemas and metadata; every ``tool`` message must answer a
    call issued by an earlier assistant message."""

    id: str
    messages: tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.messages, tuple) or not all(isinstance(m, Message) for m in self.messages):
            raise TypeError("Episode.messages must be a tuple of Message")
        if not self.messages:
            raise ValueError(f"episode {self.id!r} has no messages")
        issued: set[str] = set()
        for i, m in enumerate(self.messages):
            issued.update(c.id for c in m.tool_calls)
            if m.role == "tool" and m.tool_call_id not in issued:
                raise ValueError(
                    f"episode {self.id!r} message {i}: tool result answers unknown call "
                    f"{m.tool_call_id!r} (no earlier assistant tool call has that id)"
                )

    def assistant_turns(self) -> list[int]:
        """Indices of assistant messages (the student's actions; each is a replay state)."""
        return [i for i, m in enumerate(self.messages) if m.role == "assistant"]

    def issuing_turn(self, tool_call_id: str) -> int:
        """Index of the assistant message that issued ``tool_call_id``."""
        for i, m in enumerate(self.messages):
            if any(c.id == tool_call_id for c in m.tool_calls):
                return i
        raise KeyError(tool_call_id)

    def tool_call(self, tool_call_id: str) -> ToolCall:
        calls = self.messages[self.issuing_turn(tool_call_id)].tool_calls
        return next(c for c in calls if c.id == tool_call_id)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "messages": [m.to_dict() for m in self.messages]}
        if self.tools:
            out["tools"] = [dict(t) for t in self.tools]
        if self.metadata:
            out["metadata"] = dict(self.metadata)
        return out


def state_hash(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] = ()) -> str:
    """SHA-256 of the canonical JSON of a state (the messages a policy sees, plus tool schemas)."""
    payload = {"messages": [m.to_api_dict() for m in messages], "tools": [dict(t) for t in tools]}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def episode_from_dict(d: Any, default_id: str, where: str = "episode") -> Episode:
    """Build an :class:`Episode` from ``{"id", "messages", "tools", "metadata"}`` or a bare list."""
    if isinstance(d, list):
        d = {"messages": d}
    if not isinstance(d, Mapping) or not isinstance(d.get("messages"), list):
        raise ValueError(f"{where}: expected an object with a 'messages' list (OpenAI chat format)")
    messages = tuple(message_from_dict(m, f"{where}.messages[{i}]") for i, m in enumerate(d["messages"]))
    tools = d.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise ValueError(f"{where}: tools must be a list of OpenAI tool schemas")
    metadata = d.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise ValueError(f"{where}: metadata must be an object")
    try:
        return Episode(str(d.get("id") or default_id), messages, tuple(tools), dict(metadata))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e


def read_openai_jsonl(path: str | Path) -> list[Episode]:
    """Read OpenAI-format episodes, one per line. Errors name ``file:line``."""
    p = Path(path)
    return [episode_from_dict(obj, f"{p.stem}-{n}", f"{p}:{n}") for n, obj in _json_lines(p)]


def write_openai_jsonl(episodes: Iterable[Episode], path: str | Path) -> None:
    """Write episodes in the format :func:`read_openai_jsonl` reads."""
    with Path(path).open("w", encoding="utf-8") as f:
        for ep in episodes:
            f.write(json.dumps(ep.to_dict(), ensure_ascii=False) + "\n")


def read_claude_code_jsonl(path: str | Path) -> list[Episode]:
    """Read a Claude Code session file into episodes (one per ``sessionId``).

    ``tool_use`` blocks become :class:`ToolCall` s, ``tool_result`` blocks ``tool`` messages; other entry
    types, side-chain / meta entries and ``thinking`` blocks are skipped, and consecutive assistant entries
    sharing ``message.id`` are merged.
    """
    p = Path(path)
    sessions: dict[str, list[Message]] = {}
    last_assistant_id: dict[str, str | None] = {}
    for n, obj in _json_lines(p):
        where = f"{p}:{n}"
        if not isinstance(obj, Mapping):
            raise ValueError(f"{where}: expected a JSON object per line (Claude Code session entry)")
        kind = obj.get("type")
        if kind not in ("user", "assistant") or obj.get("isSidechain") or obj.get("isMeta"):
            continue
        msg = obj.get("message")
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where}: {kind} entry without a 'message' object")
        sid = str(obj.get("sessionId") or p.stem)
        out = sessions.setdefault(sid, [])
        content = msg.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        results, text, calls = _entry_blocks(kind, blocks, where)
        mid = msg.get("id") if kind == "assistant" else None
        if mid is not None and last_assistant_id.get(sid) == mid:  # out[-1] is that entry's message
            prev = out[-1]
            merged_text = "".join(t for t in (prev.content, text) if t) or None
            out[-1] = Message("assistant", merged_text, prev.tool_calls + calls)
        elif kind == "assistant" and (text or calls):
            out.append(Message("assistant", text or None, calls))
        out += results
        if kind == "user" and text is not None:
            out.append(Message("user", text))
        if kind == "user" or text or calls:
            last_assistant_id[sid] = None if mid is None else str(mid)
    episodes = []
    for sid, msgs in sessions.items():
        if not msgs:
            continue
        try:
            episodes.append(Episode(sid, tuple(msgs), (), {"source": "claude-code", "file": str(p)}))
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from e
    return episodes


def _entry_blocks(
    kind: str, blocks: list[Any], where: str
) -> tuple[list[Message], str | None, tuple[ToolCall, ...]]:
    """One entry's content blocks: (a ``tool`` message per tool result, its text or None, its tool calls)."""
    results: list[Message] = []
    text: list[str] = []
    calls: list[ToolCall] = []
    for b in blocks:
        btype = (b.get("type") if isinstance(b, Mapping) else None, kind)
        if btype[0] == "text":
            text.append(str(b.get("text", "")))
        elif btype == ("image", "user"):
            text.append("[image]")
        elif btype == ("tool_use", "assistant"):
            calls.append(ToolCall(str(b.get("id")), str(b.get("name")), canonical_json(b.get("input", {}))))
        elif btype == ("tool_result", "user"):
            tool_text = _content_to_text(b.get("content"), where) or ""
            call_id = str(b.get("tool_use_id"))
            results.append(Message("tool", tool_text, tool_call_id=call_id, is_error=bool(b.get("is_error"))))
        elif btype not in (("thinking", "assistant"), ("redacted_thinking", "assistant")):
            raise ValueError(f"{where}: unsupported {kind} content block {btype[0]!r}")
    return results, "".join(text) if text else None, tuple(calls)


def read_traces(path: str | Path, fmt: Literal["auto", "openai", "claude-code"] = "auto") -> list[Episode]:
    """Read episodes from a JSONL file; ``fmt="auto"`` looks at the first entry."""
    p, readers = Path(path), {"openai": read_openai_jsonl, "claude-code": read_claude_code_jsonl}
    if fmt not in (*readers, "auto"):
        raise ValueError(f"fmt must be 'auto', 'openai' or 'claude-code', got {fmt!r}")
    if fmt == "auto":  # a Claude Code entry has no "messages" but a "sessionId" or "type"
        first = next((obj for _, obj in _json_lines(p)), None)
        keys = set(first) if isinstance(first, Mapping) else set()
        fmt = "claude-code" if "messages" not in keys and keys & {"sessionId", "type"} else "openai"
    return readers[fmt](p)


# --- error sites --------------------------------------------------------------------------

_TEST_FAILURE = [
    re.compile(r"^=+ .*\b\d+ (failed|errors?)\b.* =+$", re.M),  # pytest summary line
    re.compile(r"^(FAILED|ERROR) \S+::", re.M),  # pytest -ra short summary
    re.compile(r"^FAILED \(.*(failures|errors)=\d+", re.M),  # unittest
    re.compile(r"^Tests?:\s+\d+ failed", re.M),  # jest
    re.compile(r"^--- FAIL: ", re.M),  # go test
    re.compile(r"^test result: FAILED\.", re.M),  # cargo test
]
_EXIT_CODE = re.compile(
    r"(?:exit(?:ed)?(?: with)? (?:code|status)|returncode|return code)\s*[:=]?\s*(-?\d+)", re.I
)
_TOOL_ERROR = [
    re.compile(r"^Traceback \(most recent call last\):", re.M),
    re.compile(r"^(?:bash: |sh: |zsh: )?.*: (?:command not found|No such file or directory)$", re.M),
    re.compile(r"^(?:[A-Za-z_][\w.]*)?(?:Error|Exception): ", re.M),
]


@dataclass(frozen=True)
class ErrorSite:
    """A failed tool result (message ``turn``) and the assistant message whose call failed (``action_turn``);
    ``kinds`` lists every signal found, ``evidence`` is the tool output."""

    episode_id: str
    turn: int
    action_turn: int
    tool_call_id: str
    tool_name: str
    kinds: tuple[ErrorKind, ...]
    evidence: str
    exit_code: int | None = None


def _exit_code(m: Message) -> int | None:
    if m.exit_code is not None:
        return m.exit_code
    codes = [int(x) for x in _EXIT_CODE.findall(m.text)]
    nonzero = [c for c in codes if c != 0]
    return nonzero[0] if nonzero else (0 if codes else None)


def find_error_sites(episode: Episode) -> list[ErrorSite]:
    """Every tool result that shows a tool error, a failing test run or a non-zero exit code (the signals:
    ``is_error`` / ``exit_code`` set by the harness, and the patterns above; the package README lists them)."""
    sites: list[ErrorSite] = []
    for i, m in enumerate(episode.messages):
        if m.role != "tool" or m.tool_call_id is None:
            continue
        kinds: list[ErrorKind] = []
        if m.is_error or any(p.search(m.text) for p in _TOOL_ERROR):
            kinds.append("tool_error")
        if any(p.search(m.text) for p in _TEST_FAILURE):
            kinds.append("test_failure")
        code = _exit_code(m)
        if code is not None and code != 0:
            kinds.append("exit_code")
        if kinds:
            action = episode.issuing_turn(m.tool_call_id)
            name = episode.tool_call(m.tool_call_id).name
            sites.append(
                ErrorSite(episode.id, i, action, m.tool_call_id, name, tuple(kinds), m.text, code or None)
            )
    return sites
