"""Preference pairs from teacher replay (channel 3 data), on typed messages.

At a student state (the messages before the student's assistant turn ``y_S``), the pair is ``chosen`` =
the most common teacher action a **verifier** accepts or, without one, the **strict majority** action of
the teachers that answered; ``rejected`` = ``y_S``. No pair is made when no action qualifies or when the
chosen action is the student's after normalisation (NFC, whitespace collapsed, tool-call arguments as
canonical JSON). The functions take only ``Message`` / ``str`` and raise ``TypeError`` for anything else,
so no filter can silently measure the dict form of a message.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .replay import ReplayResult
from .schema import Episode, Message, canonical_json, state_hash

__all__ = [
    "PreferencePair",
    "Verifier",
    "action_key",
    "action_length",
    "filter_pairs",
    "make_pair",
    "normalize_text",
]

Verifier = Callable[[Episode, int, Message], bool]
_WS = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """NFC, collapse whitespace runs to one space, trim. Only ``str`` is accepted."""
    if not isinstance(text, str):
        raise TypeError(
            f"normalize_text takes str, got {type(text).__name__}; messages are typed — "
            "normalise Message objects with action_key()/action_length(), not their dict form"
        )
    return _WS.sub(" ", unicodedata.normalize("NFC", text)).strip()


def _require_message(m: object, what: str) -> Message:
    if not isinstance(m, Message):
        raise TypeError(f"{what} must be a composer_core.traces.Message, got {type(m).__name__}")
    return m


def _canonical_args(arguments: str) -> str:
    try:
        return canonical_json(json.loads(arguments))
    except ValueError:
        return normalize_text(arguments)


def action_key(m: Message) -> str:
    """Normalised identity of an action: text + tool calls (name, canonical args; ids ignored)."""
    m = _require_message(m, "action")
    calls = [[c.name, _canonical_args(c.arguments)] for c in m.tool_calls]
    return canonical_json([normalize_text(m.text), calls])


def action_length(m: Message) -> int:
    """Characters of an action's normalised content plus its tool calls' names and canonical arguments."""
    m = _require_message(m, "action")
    return len(normalize_text(m.text)) + sum(
        len(c.name) + len(_canonical_args(c.arguments)) for c in m.tool_calls
    )


@dataclass(frozen=True)
class PreferencePair:
    """One preference pair at a student state (typed; validated)."""

    episode_id: str
    turn: int
    prompt: tuple[Message, ...]
    chosen: Message
    rejected: Message
    chosen_by: Literal["verifier", "majority"]
    teachers: tuple[str, ...]
    answered: int
    tools: tuple[Mapping[str, Any], ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require_message(self.chosen, "chosen")
        _require_message(self.rejected, "rejected")
        if not isinstance(self.prompt, tuple):
            raise TypeError("prompt must be a tuple of Message")
        for i, m in enumerate(self.prompt):
            _require_message(m, f"prompt[{i}]")
        if self.chosen.role != "assistant" or self.rejected.role != "assistant":
            raise ValueError("chosen and rejected must be assistant messages")
        if action_key(self.chosen) == action_key(self.rejected):
            raise ValueError("chosen and rejected are the same action after normalisation")


def make_pair(
    episode: Episode, turn: int, results: Sequence[ReplayResult], *, verifier: Verifier | None = None
) -> PreferencePair | None:
    """Pair at ``episode.messages[turn]`` from the teachers' ``results`` (failed ones ignored), or None.

    Ties between accepted actions go to the first in teacher order.
    """
    student = episode.messages[turn]
    if student.role != "assistant":
        raise ValueError(f"turn {turn} of {episode.id!r} is a {student.role} message, not a student action")
    answers = [(r.teacher, r.message) for r in results if r.message is not None]
    if not answers:
        return None
    chosen_by: Literal["verifier", "majority"] = "majority" if verifier is None else "verifier"
    pool = [
        (t, m)
        for t, m in answers
        if verifier is None or (m.role == "assistant" and verifier(episode, turn, m))
    ]
    if not pool:
        return None
    keys = [action_key(m) for _, m in pool]
    ((best_key, best),) = Counter(keys).most_common(1)  # ties: first seen
    if (verifier is None and 2 * best <= len(answers)) or best_key == action_key(student):
        return None
    voters = tuple(t for (t, _), k in zip(pool, keys) if k == best_key)
    chosen = pool[keys.index(best_key)][1]
    state = episode.messages[:turn]
    return PreferencePair(
        episode.id, turn, state, chosen, student, chosen_by, voters, len(answers), episode.tools
    )


def filter_pairs(
    pairs: Sequence[PreferencePair], *, min_chars: int = 1, max_chars: int | None = None, dedupe: bool = True
) -> tuple[list[PreferencePair], dict[str, int]]:
    """Keep pairs whose chosen and rejected :func:`action_length` lie in ``[min_chars, max_chars]``, and
    (``dedupe``) the first of those with the same state and normalised actions; returns them and drop counts."""
    if min_chars < 0 or (max_chars is not None and max_chars < min_chars):
        raise ValueError(
            f"need 0 <= min_chars <= max_chars, got min_chars={min_chars}, max_chars={max_chars}"
        )
    kept: list[PreferencePair] = []
    dropped = {"too_short": 0, "too_long": 0, "duplicate": 0}
    seen: set[tuple[str, str, str]] = set()
    for p in pairs:
        if not isinstance(p, PreferencePair):
            raise TypeError(f"filter_pairs takes PreferencePair objects, got {type(p).__name__}")
        lengths = (action_length(p.chosen), action_length(p.rejected))
        if min(lengths) < min_chars:
            dropped["too_short"] += 1
            continue
        if max_chars is not None and max(lengths) > max_chars:
            dropped["too_long"] += 1
            continue
        if dedupe:
            k = (state_hash(p.prompt, p.tools), action_key(p.chosen), action_key(p.rejected))
            if k in seen:
                dropped["duplicate"] += 1
                continue
            seen.add(k)
        kept.append(p)
    return kept, dropped
