"""The embedded verifiable task of ``composer-train``: digit reversal.

A prompt is a digit string followed by ``>``; the correct completion is the same digits reversed::

    prompt "3817>"   answer "7183"

Three pure functions make it a complete RL environment for the three channels:

- :func:`verify` is the reward (partial credit: the fraction of positions right, so a tiny model's
  reward rises smoothly instead of staying at 0 until it is perfect);
- :func:`feedback_hint` turns the verifier's feedback on one completion into the hint of channel 2
  (the positions the student got wrong, with the expected digit, ``.`` where it was right) — the
  teacher is the same model reading that feedback in front of the prompt;
- :func:`oracle_solve` is the teacher trace of channel 3 (``chosen``); the ``rejected`` side is a
  typical wrong answer (the digits copied unreversed), so the pair says "reverse, don't copy".

The alphabet is 13 characters (digits, ``>``, ``|``, ``.``), so :mod:`composer_trl.tiny` can build a
character tokenizer for it without any download.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

ALPHABET = "0123456789>|."
"""Every character a prompt, an answer or a hint of this task can contain."""


def make_prompt(digits: str) -> str:
    """The prompt for ``digits``: ``"381" -> "381>"``."""
    return f"{digits}>"


def oracle_solve(prompt: str) -> str:
    """The correct completion of ``prompt`` (the oracle teacher of channel 3)."""
    return _digits(prompt)[::-1]


def wrong_solution(prompt: str) -> str:
    """A typical wrong completion: the digits copied in order (the ``rejected`` side of the pair)."""
    digits = _digits(prompt)
    if digits == digits[::-1]:  # a palindrome's copy is correct: rotate it instead
        return digits[1:] + digits[:1] if len(set(digits)) > 1 else _bump(digits)
    return digits


def verify(prompt: str, completion: str) -> float:
    """Reward in [0, 1]: ``#{i : completion[i] == answer[i]} / max(len(completion), len(answer))``.

    Extra or missing characters cost through the denominator, so only the exact answer scores 1.
    """
    answer = oracle_solve(prompt)
    completion = completion.strip()
    right = sum(a == b for a, b in zip(completion, answer))
    return right / max(len(completion), len(answer), 1)


def feedback_hint(prompt: str, completion: str) -> str | None:
    """The verifier's feedback as a hint, or None when the completion is already correct.

    One character per answer position: the expected digit where the completion is wrong, ``.`` where it
    is right, then ``|``. For ``"381>"`` and the completion ``"133"`` the hint is ``".8.|"``.
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
    """TRL reward function (``reward_funcs=[reverse_reward]``) wrapping :func:`verify`."""
    return [verify(p, c) for p, c in zip(prompts, completions, strict=True)]


def reverse_hints(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[str | None]:
    """Hint function for :class:`~composer_trl.ComposerGRPOTrainer` (``hint_fn=reverse_hints``)."""
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
        prompt = make_prompt("".join(rng.choice("0123456789") for _ in range(k)))
        rows.append({"prompt": prompt, "chosen": oracle_solve(prompt), "rejected": wrong_solution(prompt)})
    return rows


def _digits(prompt: str) -> str:
    body = prompt.rsplit("|", 1)[-1]  # a hinted prompt carries the hint before "|"
    body = body.strip().removesuffix(">")
    if not body.isdigit():
        raise ValueError(f"not a digit-reversal prompt: {prompt!r} (expected digits followed by '>')")
    return body


def _bump(digits: str) -> str:
    return str((int(digits[0]) + 1) % 10) + digits[1:]
