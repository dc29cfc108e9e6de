"""Hinted teacher contexts and token-level SDPO masks (channel 2 data).

SDPO (Hübotter et al., "Reinforcement Learning via Self-Distillation", arXiv 2601.20802) uses the *same*
policy as teacher, re-prompted with a textual hint ``f`` about what went wrong::

    L = Σ_t M_t · D( πθ(· | x, y<t) ‖ sg πθ(· | x, f, y<t) )

``x`` is the student's context up to the faulty turn, ``y`` the student's action there; the teacher
context is ``x`` with one hint message inserted right before the action (:func:`build_hinted_context`),
and ``M`` is the SDPO mask over the tokens of ``y`` (:func:`tokenize_hinted`, tokenised as TRL does: the
package README's "Error sites, hints and masks"). Hint sources are any
``Callable[[Episode, ErrorSite], str]``: :func:`error_text_hint`, :class:`TemplateHint`,
:class:`TeacherHint`. Host producers import a user's hint function with :func:`load_hint_fn` and ask it
per row with :func:`hint_jobs`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from string import Formatter
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from .schema import Episode, ErrorSite, Message

if TYPE_CHECKING:  # pragma: no cover
    from .replay import Replayer

__all__ = [
    "HintJob",
    "HintSource",
    "HintedContext",
    "TeacherHint",
    "TemplateHint",
    "TokenizedHinted",
    "build_hinted_context",
    "error_text_hint",
    "hint_jobs",
    "hint_token_span",
    "load_hint_fn",
    "render_completion",
    "render_plain",
    "tokenize_completion",
    "tokenize_hinted",
]

HintSource = Callable[[Episode, ErrorSite], str]
T = TypeVar("T")


def load_hint_fn(path: str, *, option: str) -> Callable[..., Any]:
    """Import ``package.module:function`` (or ``package.module.function``); errors name ``option``."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{option}={path!r}: expected an import path 'package.module:function'.")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{option}={path!r} cannot be imported ({e}).") from e
    if not callable(fn):
        raise ValueError(f"{option}={path!r} is not callable.")
    return fn  # type: ignore[no-any-return]


@dataclass(frozen=True)
class HintJob(Generic[T]):
    """One row to re-score on its hinted context: its position, the row, and the hint text."""

    index: int
    item: T
    hint: str


def hint_jobs(
    items: Sequence[T],
    hint_of: Callable[[T], object],
    *,
    option: str,
    template: str = "{hint}",
    skip: Collection[int] = (),
) -> list[HintJob[T]]:
    """The rows of ``items`` that get a hint, in order: ``hint_of(item)`` formatted into ``template``.

    ``None`` or a blank string means "no hint"; any other non-string raises ``ValueError`` naming ``option``.
    Rows whose index is in ``skip`` are not asked.
    """
    if "{hint}" not in template:
        raise ValueError(f"template={template!r} must contain '{{hint}}'.")
    jobs: list[HintJob[T]] = []
    for i, item in enumerate(items):
        if i in skip:
            continue
        raw = hint_of(item)
        if raw is None:
            continue
        if not isinstance(raw, str):
            raise ValueError(f"{option} answered {type(raw).__name__} for row {i}: return a string or None.")
        if raw.strip():
            jobs.append(HintJob(i, item, template.format(hint=raw)))
    return jobs


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + "\n[...]\n" + text[-(max_chars - half) :]


class TemplateHint:
    """Hint from a ``str.format`` template with the fields ``{tool_name}``, ``{arguments}`` (the faulty call's
    JSON), ``{error}`` (tool output, head and tail kept within ``max_chars``), ``{kinds}``, ``{exit_code}``."""

    FIELDS = frozenset({"tool_name", "arguments", "error", "kinds", "exit_code"})

    def __init__(self, template: str, max_chars: int = 2000) -> None:
        names = {f for _, f, _, _ in Formatter().parse(template) if f is not None}
        unknown = names - self.FIELDS
        if unknown:
            raise ValueError(
                f"template uses unknown fields {sorted(unknown)}; available: {sorted(self.FIELDS)}"
            )
        if not template.strip():
            raise ValueError("template is empty")
        self.template = template
        self.max_chars = max_chars

    def __call__(self, episode: Episode, site: ErrorSite) -> str:
        return self.template.format(
            tool_name=site.tool_name,
            arguments=episode.tool_call(site.tool_call_id).arguments,
            error=_truncate(site.evidence, self.max_chars),
            kinds=", ".join(site.kinds),
            exit_code="" if site.exit_code is None else site.exit_code,
        )


class TeacherHint:
    """Hint written by a teacher model (via a Replayer, cached) that sees the episode up to the failed tool
    result plus ``instruction``; a teacher that finally fails raises ``RuntimeError`` with the reason."""

    DEFAULT_INSTRUCTION = (
        "The last tool call failed. In at most three sentences, write a hint for the agent that "
        "made the call describing what it should do differently. Do not write the fix itself."
    )

    def __init__(self, replayer: Replayer, teacher: str, instruction: str = DEFAULT_INSTRUCTION) -> None:
        if teacher not in replayer.teacher_names:
            raise ValueError(f"teacher {teacher!r} is not configured; known: {replayer.teacher_names}")
        self.replayer = replayer
        self.teacher = teacher
        self.instruction = instruction

    def __call__(self, episode: Episode, site: ErrorSite) -> str:
        state = (*episode.messages[: site.turn + 1], Message("user", self.instruction))
        result = self.replayer.complete(self.teacher, state, tools=episode.tools)
        if result.message is None or not result.message.text.strip():
            raise RuntimeError(
                f"teacher {self.teacher!r} gave no hint for {site.episode_id}@{site.turn}: "
                f"{result.failure or 'empty answer'}"
            )
        return result.message.text.strip()


def error_text_hint(max_chars: int = 2000) -> HintSource:
    """Hint = the tool's error output (head and tail kept when longer than ``max_chars``)."""
    if max_chars < 16:
        raise ValueError(f"max_chars must be >= 16, got {max_chars}")
    return TemplateHint(
        "Hint: your call to `{tool_name}` here fails ({kinds}). The tool reports:\n{error}", max_chars
    )


@dataclass(frozen=True)
class HintedContext:
    """Student and teacher contexts of one SDPO site (``teacher_prompt[hint_index]`` is the hint message)."""

    episode_id: str
    turn: int
    prompt: tuple[Message, ...]
    completion: Message
    teacher_prompt: tuple[Message, ...]
    hint: str
    hint_index: int
    tools: tuple[Mapping[str, Any], ...] = ()


def build_hinted_context(
    episode: Episode, site: ErrorSite, source: HintSource, *, role: Literal["user", "system"] = "user"
) -> HintedContext:
    """Teacher context = the student's context plus one ``role`` hint message right before the faulty action."""
    if role not in ("user", "system"):
        raise ValueError(f"role must be 'user' or 'system', got {role!r}")
    if site.episode_id != episode.id:
        raise ValueError(f"site belongs to episode {site.episode_id!r}, not {episode.id!r}")
    action = episode.messages[site.action_turn]
    if action.role != "assistant":
        raise ValueError(
            f"site.action_turn={site.action_turn} is a {action.role} message, not the student's action"
        )
    hint = source(episode, site)
    if not isinstance(hint, str) or not hint.strip():
        raise ValueError(f"hint source returned an empty hint for {episode.id}@{site.action_turn}")
    prompt = episode.messages[: site.action_turn]
    teacher = (*prompt, Message(role, hint))
    return HintedContext(
        episode.id, site.action_turn, prompt, action, teacher, hint, len(prompt), episode.tools
    )


def render_plain(messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
    """Plain-text rendering for tokenizers without a chat template.

    Each message is ``<|role|>\\n{content}\\n`` followed, for tool calls, by one
    ``<|tool_call|>{name} {arguments}\\n`` line per call (arguments verbatim) and ``<|end|>\\n``.
    ``add_generation_prompt`` appends ``<|assistant|>\\n``.
    """
    out: list[str] = []
    for m in messages:
        head = f"<|{m.role}|>" if m.role != "tool" else f"<|tool|>{m.tool_call_id}"
        out.append(f"{head}\n{m.text}\n")
        for c in m.tool_calls:
            out.append(f"<|tool_call|>{c.name} {c.arguments}\n")
        out.append("<|end|>\n")
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return "".join(out)


def _template_dict(m: Message) -> dict[str, Any]:
    d = m.to_api_dict()
    if m.tool_calls:  # HF templates expect parsed arguments (a mapping) when they are JSON objects
        d["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.parsed_arguments()}}
            for c in m.tool_calls
        ]
    return d


def _render_template(
    tokenizer: Any, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]], gen: bool
) -> str:
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": gen}
    if tools:
        kwargs["tools"] = [dict(t) for t in tools]
    text = tokenizer.apply_chat_template([_template_dict(m) for m in messages], **kwargs)
    if not isinstance(text, str):
        raise TypeError("tokenizer.apply_chat_template(tokenize=False) did not return a string")
    return text


def _encode(tokenizer: Any, text: str, special: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of ``text``."""
    try:
        enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
        return ids, offsets
    except (NotImplementedError, KeyError, ValueError):
        pass
    # Slow tokenizers: offsets from decoding growing prefixes (O(n²), exact for lossless tokenizers).
    ids = list(tokenizer(text, add_special_tokens=special)["input_ids"])
    offsets, prev = [], 0
    for k in range(len(ids)):
        end = min(len(tokenizer.decode(ids[: k + 1])), len(text))
        offsets.append((prev, end))
        prev = end
    return ids, offsets


def render_completion(
    tokenizer: Any,
    prompt: Sequence[Message],
    completion: Message,
    tools: Sequence[Mapping[str, Any]] = (),
    *,
    chat_template: bool | None = None,
) -> tuple[str, str, bool]:
    """``(prompt_text, completion_text, add_special_tokens_to_prompt)`` for one action.

    With a chat template, ``completion_text`` is the rendering of ``prompt + [completion]`` minus the
    prompt's (with ``add_generation_prompt``); without one, :func:`render_plain`.
    """
    use_template = bool(getattr(tokenizer, "chat_template", None)) if chat_template is None else chat_template
    if not use_template:
        prompt_text = render_plain(prompt, add_generation_prompt=True)
        return prompt_text, render_plain((completion,))[len("<|assistant|>\n") :], True
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template=True but tokenizer has no chat_template; pass chat_template=False")
    prompt_text = _render_template(tokenizer, prompt, tools, True)
    full = _render_template(tokenizer, (*prompt, completion), tools, False)
    if not full.startswith(prompt_text):
        raise ValueError(
            "the chat template renders the prompt differently once the completion is appended "
            "(it rewrites earlier turns), so completion tokens cannot be isolated; use "
            "chat_template=False or a template that only appends"
        )
    return prompt_text, full[len(prompt_text) :], False


def tokenize_completion(
    tokenizer: Any,
    prompt: Sequence[Message],
    completion: Message,
    tools: Sequence[Mapping[str, Any]] = (),
    *,
    chat_template: bool | None = None,
) -> tuple[list[int], list[int]]:
    """``(prompt_ids, completion_ids)`` of one action, tokenised separately (TRL convention)."""
    prompt_text, completion_text, special = render_completion(
        tokenizer, prompt, completion, tools, chat_template=chat_template
    )
    prompt_ids, _ = _encode(tokenizer, prompt_text, special)
    completion_ids, _ = _encode(tokenizer, completion_text, False)
    if not completion_ids:
        raise ValueError("the completion tokenises to nothing")
    return prompt_ids, completion_ids


@dataclass(frozen=True)
class TokenizedHinted:
    """Token ids of one SDPO site (student: ``prompt_ids + completion_ids``, teacher:
    ``teacher_prompt_ids + completion_ids``); ``sdpo_mask[t]`` marks ``completion_ids[t]``."""

    prompt_ids: list[int]
    teacher_prompt_ids: list[int]
    completion_ids: list[int]
    sdpo_mask: list[int]
    completion_text: str
    prompt_text: str
    teacher_prompt_text: str


def tokenize_hinted(
    ctx: HintedContext,
    tokenizer: Any,
    *,
    chat_template: bool | None = None,
    mask_spans: Sequence[tuple[int, int]] | None = None,
    mask_text: str | None = None,
) -> TokenizedHinted:
    """Tokenise student and teacher contexts and build the SDPO mask over completion tokens.

    ``tokenizer``: any Hugging Face tokenizer; ``chat_template=None`` uses its template when it has one.
    The mask covers every completion token, or only those overlapping ``mask_spans`` (character spans of
    ``completion_text``) or ``mask_text`` (a substring of it).
    """
    if mask_spans is not None and mask_text is not None:
        raise ValueError("pass mask_spans or mask_text, not both")
    prompt_text, completion_text, special = render_completion(
        tokenizer, ctx.prompt, ctx.completion, ctx.tools, chat_template=chat_template
    )
    teacher_text, teacher_completion, _ = render_completion(
        tokenizer, ctx.teacher_prompt, ctx.completion, ctx.tools, chat_template=chat_template
    )
    if teacher_completion != completion_text:
        raise ValueError("the chat template renders the completion differently after the hint")
    prompt_ids, _ = _encode(tokenizer, prompt_text, special)
    teacher_ids, _ = _encode(tokenizer, teacher_text, special)
    completion_ids, offsets = _encode(tokenizer, completion_text, False)
    if not completion_ids:
        raise ValueError(f"the completion of {ctx.episode_id}@{ctx.turn} tokenises to nothing")
    if mask_text is not None:
        start = completion_text.find(mask_text)
        if start < 0:
            raise ValueError(f"mask_text {mask_text[:40]!r} does not occur in the rendered completion")
        mask_spans = [(start, start + len(mask_text))]
    if mask_spans is None:
        mask = [1] * len(completion_ids)
    else:
        for a, b in mask_spans:
            if not 0 <= a < b <= len(completion_text):
                raise ValueError(
                    f"mask span ({a}, {b}) is outside the completion text [0, {len(completion_text)})"
                )
        mask = [int(any(s < b and a < e for a, b in mask_spans)) for s, e in offsets]
        if not any(mask):
            raise ValueError("the mask spans cover no completion token")
    return TokenizedHinted(
        prompt_ids, teacher_ids, completion_ids, mask, completion_text, prompt_text, teacher_text
    )


def hint_token_span(prompt_ids: Sequence[int], teacher_prompt_ids: Sequence[int]) -> tuple[int, int]:
    """``(start, end)`` such that ``teacher[:start] + teacher[end:] == prompt``.

    ``ValueError`` when they differ by more than one contiguous inserted run; when several placements are
    valid (repeated boundary tokens), the one furthest right.
    """
    n, m = len(prompt_ids), len(teacher_prompt_ids)
    if m <= n:
        raise ValueError("the teacher prompt is not longer than the student prompt")
    pre = 0
    while pre < n and prompt_ids[pre] == teacher_prompt_ids[pre]:
        pre += 1
    suf = 0
    while suf < n - pre and prompt_ids[n - 1 - suf] == teacher_prompt_ids[m - 1 - suf]:
        suf += 1
    if pre + suf != n:
        raise ValueError(
            f"contexts differ outside one inserted run (common prefix {pre}, suffix {suf}, prompt {n})"
        )
    return pre, m - suf
