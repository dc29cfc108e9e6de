"""Two-digit addition for a real instruct model: a task a 135M model can start on and learn from its group.

With the prompt ``"Compute 47 + 38. Reply with just the result."`` SmolLM2-135M-Instruct answers
``"47 + 38 = 85"`` or one sentence ending in it, right on about a third of the sums given 32 tokens (greedy, base
model: composer-trl's ``bench/addition_budget.py``), so most groups hold both successes and failures. The rules
are pure Python, one implementation for every host (each function states its own); the reference
``"47 + 38 = 85"`` is channel 3's ``chosen`` and the SFT target, and choices made by looking at results use the
validation split, never the held-out one (:func:`task_splits`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

__all__ = [
    "FEEDBACK_REVEALS",
    "HELD_OUT_SIZE",
    "PROMPT",
    "VALIDATION_SIZE",
    "Splits",
    "addition_feedback",
    "addition_reward",
    "extract_answer",
    "feedback",
    "make_rows",
    "operands",
    "reference_answer",
    "split_rows",
    "task_splits",
    "verify",
    "wrong_answer",
]

PROMPT = "Compute {a} + {b}. Reply with just the result."
_OPERANDS = re.compile(r"Compute (\d+) \+ (\d+)\.")
_RESULT = re.compile(
    r"(?:=|\bequals?(?:\s+to)?\b|\bis\b|\bresults?\s+in\b|\bgives(?:\s+us)?\b|:)[\s*$]*(\d+)"
    r"(?![\w-]|\s*(?:[-+*/×]|plus|and|minus|times)\s*\d)"  # not the first number of an expression
)
_BARE = re.compile(r"[\s*$]*(\d+)[\s*$.!]*")
FEEDBACK_REVEALS = (
    "verifier feedback: wrong digit places, direction, carry hint — partial reference information"
)
"""What :func:`feedback` tells the teacher, as a benchmark table labels it."""
HELD_OUT_SIZE, VALIDATION_SIZE = 256, 128
_SPLIT_SEED = 59_000  # the held-out sums; the validation sums use _SPLIT_SEED + 1


def _text(prompt: Any) -> str:
    """The user text of a prompt (a string or a chat message list)."""
    if isinstance(prompt, str):
        return prompt
    return str(next(m["content"] for m in reversed(prompt) if m.get("role") == "user"))


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion if m.get("role") == "assistant")


def operands(prompt: Any) -> tuple[int, int]:
    """``(a, b)`` of a prompt made by :func:`make_rows`."""
    m = _OPERANDS.search(_text(prompt))
    if m is None:
        raise ValueError(f"not an addition prompt of this task: {_text(prompt)!r:.80}")
    return int(m.group(1)), int(m.group(2))


def extract_answer(completion: str, operands: Collection[int] = ()) -> int | None:
    """The integer after the reply's last result marker (not the start of an expression), else the whole reply
    when it is one number other than the ``operands``; None when the reply states no result."""
    found = [m.group(1) for m in _RESULT.finditer(completion)]
    bare = _BARE.fullmatch(completion)
    if found:
        return int(found[-1])
    return int(bare.group(1)) if bare and int(bare.group(1)) not in operands else None


def _digit_pairs(want: int, got: int) -> list[tuple[str, str]]:
    """The digits of ``want`` and ``got`` paired from the units up (the shorter one padded with blanks)."""
    a, b = str(want), str(got)
    width = max(len(a), len(b))
    return list(zip(reversed(a.rjust(width)), reversed(b.rjust(width))))


def verify(prompt: Any, completion: Any) -> float:
    """1.0 for the exact sum, else 0.5 × the fraction of the sum's digits right (aligned from the right)."""
    a, b = operands(prompt)
    got = extract_answer(_completion_text(completion), (a, b))
    if got is None:
        return 0.0
    if got == a + b:
        return 1.0
    pairs = _digit_pairs(a + b, got)
    return 0.5 * sum(x == y for x, y in pairs) / len(pairs)


def feedback(prompt: Any, completion: Any) -> str | None:
    """The verifier's feedback on a wrong answer (never the sum itself); None when the answer is right."""
    a, b = operands(prompt)
    got = extract_answer(_completion_text(completion), (a, b))
    if got is None:
        return f"The reply does not state a result for {a} + {b}."
    if got == a + b:
        return None
    places = ("units", "tens", "hundreds", "thousands")
    wrong = [places[i] if i < 4 else f"10^{i}" for i, (x, y) in enumerate(_digit_pairs(a + b, got)) if x != y]
    direction = "too large" if got > a + b else "too small"
    carry = (
        " Remember to carry the ten when the units add up to 10 or more." if (a % 10 + b % 10) >= 10 else ""
    )
    return f"{got} is wrong ({direction}): the {', '.join(wrong)} digit{'s are' if len(wrong) > 1 else ' is'} wrong.{carry}"


def reference_answer(prompt: Any) -> str:
    a, b = operands(prompt)
    return f"{a} + {b} = {a + b}"


def wrong_answer(prompt: Any) -> str:
    """The sum without the carry (digit-wise sums mod 10), or one off when there is no carry."""
    a, b = operands(prompt)
    no_carry = int("".join(str((int(x) + int(y)) % 10) for x, y in zip(str(a).zfill(2), str(b).zfill(2))))
    return f"{a} + {b} = {no_carry if no_carry != a + b else a + b + 1}"


def _row(a: int, b: int, chat: bool) -> dict[str, Any]:
    text = PROMPT.format(a=a, b=b)
    prompt: Any = [{"role": "user", "content": text}] if chat else text
    return {
        "prompt": prompt,
        "answer": str(a + b),
        "chosen": reference_answer(text),
        "rejected": wrong_answer(text),
    }


def make_rows(
    n: int, *, seed: int = 0, chat: bool = True, exclude: Sequence[tuple[int, int]] = ()
) -> list[dict[str, Any]]:
    """``n`` distinct rows ``{"prompt", "answer", "chosen", "rejected"}`` with operands in [10, 99]."""
    if not 1 <= n <= 8100 - len(exclude):
        raise ValueError(f"n must lie in [1, {8100 - len(exclude)}], got {n}")
    rng = random.Random(seed)
    taken = set(exclude)
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        pair = (rng.randint(10, 99), rng.randint(10, 99))
        if pair not in taken:
            taken.add(pair)
            rows.append(_row(*pair, chat))
    return rows


class Splits(NamedTuple):
    train: list[dict[str, Any]]
    validation: list[dict[str, Any]]
    held_out: list[dict[str, Any]]


def task_splits(seed: int, n_train: int, *, chat: bool = True) -> Splits:
    """``n_train`` training rows drawn with ``seed``; the validation and held-out rows are the same for every
    seed (drawn once with fixed seeds); the three share no sum."""
    held = make_rows(HELD_OUT_SIZE, seed=_SPLIT_SEED, chat=chat)
    taken = [operands(r["prompt"]) for r in held]
    validation = make_rows(VALIDATION_SIZE, seed=_SPLIT_SEED + 1, chat=chat, exclude=taken)
    taken += [operands(r["prompt"]) for r in validation]
    return Splits(make_rows(n_train, seed=seed, chat=chat, exclude=taken), validation, held)


def split_rows(
    seed: int, n_train: int, n_held: int, *, chat: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, held_out[:n_held])`` of :func:`task_splits`: the held-out prefix is the same for every seed."""
    if not 1 <= n_held <= HELD_OUT_SIZE:
        raise ValueError(f"n_held must lie in [1, {HELD_OUT_SIZE}], got {n_held}")
    train, _, held = task_splits(seed, n_train, chat=chat)
    return train, held[:n_held]


def addition_reward(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
    """TRL reward function (``reward_funcs=[addition_reward]``): :func:`verify` per completion."""
    return [verify(p, c) for p, c in zip(prompts, completions, strict=True)]


def addition_feedback(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[str | None]:
    """composer-trl ``hint_fn`` (the feedback of ``sdpo_teacher_context='success+feedback'``): :func:`feedback`."""
    return [feedback(p, c) for p, c in zip(prompts, completions, strict=True)]
