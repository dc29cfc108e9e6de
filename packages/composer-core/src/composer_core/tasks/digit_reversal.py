"""The embedded verifiable task: digit reversal (one reward rule, one hint rule for every adapter).

A prompt is a digit string followed by ``>``; the correct completion is the same digits reversed
(``"3817>"`` → ``"7183"``). composer-trl's main job and composer-monarch's ``ReverseDigits`` both run these
rules; :func:`encode` / :func:`decode` give the ids :func:`composer_core.tasks.tiny.build_char_tokenizer`
gives too, so Monarch and TRL see identical token ids.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

from composer_core.tasks.tiny import BOS_ID, EOS_ID, PAD_ID, char_vocab

__all__ = [
    "ALPHABET",
    "DIGITS",
    "VOCAB",
    "decode",
    "encode",
    "feedback_hint",
    "hint_template",
    "make_dataset_rows",
    "make_prompt",
    "oracle_solve",
    "prompt_digits",
    "reverse_hints",
    "reverse_reward",
    "verify",
    "wrong_solution",
]

DIGITS = "0123456789"
ALPHABET = DIGITS + ">|."
"""Every character a prompt, an answer or a hint of this task can contain."""

VOCAB: dict[str, int] = char_vocab(ALPHABET)
"""Token ids: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, then the characters of :data:`ALPHABET` from 3."""

_CHARS = {i: ch for ch, i in VOCAB.items() if len(ch) == 1}


def make_prompt(digits: str) -> str:
    """The prompt for ``digits``: ``"381" -> "381>"``."""
    if not digits.isdigit():
        raise ValueError(f"digits={digits!r}: expected a non-empty string of 0-9")
    return f"{digits}>"


def prompt_digits(prompt: str) -> str:
    """The digits of a (possibly hinted) prompt: ``"381>" -> "381"``, ``".8.|381>" -> "381"``."""
    body = prompt.rsplit("|", 1)[-1]  # a hinted prompt carries the hint before "|"
    body = body.strip().removesuffix(">")
    if not body.isdigit():
        raise ValueError(f"not a digit-reversal prompt: {prompt!r} (expected digits followed by '>')")
    return body


def oracle_solve(prompt: str) -> str:
    """The correct completion of ``prompt`` (the oracle teacher of channel 3)."""
    return prompt_digits(prompt)[::-1]


def wrong_solution(prompt: str) -> str:
    """A typical wrong completion: the digits copied in order (the ``rejected`` side of the pair)."""
    digits = prompt_digits(prompt)
    if digits == digits[::-1]:  # a palindrome's copy is correct: rotate it (one repeated digit: bump it)
        bumped = str((int(digits[0]) + 1) % 10) + digits[1:]
        return digits[1:] + digits[:1] if len(set(digits)) > 1 else bumped
    return digits


def verify(prompt: str, completion: str) -> float:
    """Reward in [0, 1]: ``#{i : completion[i] == answer[i]} / max(len(completion), len(answer))``.

    Surrounding whitespace is ignored. Extra or missing characters cost through the denominator, so
    only the exact answer scores 1; the empty completion scores 0.
    """
    answer = oracle_solve(prompt)
    completion = completion.strip()
    right = sum(a == b for a, b in zip(completion, answer))
    return right / max(len(completion), len(answer), 1)


def feedback_hint(prompt: str, completion: str) -> str | None:
    """The verifier's feedback as a hint, or None when the completion is already correct.

    One character per answer position: the expected digit where the completion is wrong, ``.`` where it
    is right, then ``|``. For ``"381>"`` and the completion ``"133"`` the hint is ``".8.|"``. Its length
    depends only on the prompt, so hinted prompts of equal-length prompts have equal length too.
    """
    answer = oracle_solve(prompt)
    completion = completion.strip()
    if completion == answer:
        return None
    marks = "".join("." if i < len(completion) and completion[i] == a else a for i, a in enumerate(answer))
    return f"{marks}|"


def hint_template(prompt: str, hint: str) -> str:
    """The hinted context: the feedback in front of the prompt (``".8.|381>"``)."""
    return f"{hint}{prompt}"


def reverse_reward(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    """Reward function in TRL's calling convention (``reward_funcs=[reverse_reward]``): :func:`verify`."""
    return [verify(p, c) for p, c in zip(prompts, completions, strict=True)]


def reverse_hints(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[str | None]:
    """Hint function in composer-trl's calling convention (``hint_fn=reverse_hints``): :func:`feedback_hint`."""
    return [feedback_hint(p, c) for p, c in zip(prompts, completions, strict=True)]


def make_dataset_rows(
    n: int, *, min_digits: int = 3, max_digits: int = 3, seed: int = 0
) -> list[dict[str, str]]:
    """``n`` rows ``{"prompt", "chosen", "rejected"}`` with random digit strings (reproducible by ``seed``)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.randint(min_digits, max_digits)
        prompt = make_prompt("".join(rng.choice(DIGITS) for _ in range(k)))
        rows.append({"prompt": prompt, "chosen": oracle_solve(prompt), "rejected": wrong_solution(prompt)})
    return rows


def encode(text: str) -> list[int]:
    """Token ids of ``text`` under :data:`VOCAB` (one per character; no special tokens added)."""
    unknown = sorted(set(text) - set(ALPHABET))
    if unknown:
        raise ValueError(f"text {text!r} has characters {unknown} outside the task alphabet {ALPHABET!r}")
    return [VOCAB[ch] for ch in text]


def decode(ids: Iterable[int]) -> str:
    """Text of token ids: stops at the first ``<eos>``, skips ``<pad>`` / ``<bos>`` and unknown ids.

    This is what TRL's reward functions see (``batch_decode(..., skip_special_tokens=True)`` of the
    completion up to its EOS), so a token-level host scores a completion exactly as TRL does.
    """
    out = []
    for i in ids:
        if i == EOS_ID:
            break
        if i in (PAD_ID, BOS_ID):
            continue
        out.append(_CHARS.get(int(i), ""))
    return "".join(out)
