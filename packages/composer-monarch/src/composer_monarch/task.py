"""The task interface the loop runs, and the digit-reversal task as integer tokens.

A task turns a step number into prompts, scores completions, and writes the hinted context of the
self-distillation teacher (channel 2: the same model, shown a hint about its own completion, is the
teacher). Prompts are dense integer tensors of one length: the loop does not left-pad.

:class:`ReverseDigits` runs composer-core's digit-reversal rules (:mod:`composer_core.tasks.digit_reversal`,
the same reward and hint rules as composer-trl's main job) on the token ids of its character vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from composer_core.tasks import digit_reversal as rules
from composer_core.tasks.tiny import BOS_ID, EOS_ID, PAD_ID
from torch import Tensor


@runtime_checkable
class Task(Protocol):
    """What the driver needs from a task."""

    vocab_size: int
    pad_id: int
    eos_id: int
    max_new_tokens: int

    def prompts(self, n: int, *, step: int) -> Tensor:
        """``n`` prompts for ``step``, shape [n, P] (long), deterministic in ``step``."""
        ...

    def hinted_prompts(
        self, prompts: Tensor, completions: Tensor, completion_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The teacher's context for each completion and which completions have a hint.

        prompts [n, P] (one row per completion), completions [n, T] and completion_mask [n, T] (bool)
        → (hinted prompts [n, P'] long, has_hint [n] bool). Rows without a hint are not distilled
        (their hinted row is any valid context of length P').
        """
        ...

    def reward(self, prompt: Tensor, completion: Tensor) -> float:
        """Reward of one completion (unpadded, shape [t]) for one prompt (shape [P])."""
        ...


@dataclass(frozen=True)
class ReverseDigits:
    """Reverse ``length`` digits, then stop: ``"381>"`` → ``"183"`` + EOS, as token ids.

    Ids are composer-core's character vocabulary (:data:`composer_core.tasks.digit_reversal.VOCAB`:
    PAD=0, EOS=1, BOS=2, ``"0"``..``"9"`` = 3..12, ``">"`` = 13, ``"|"`` = 14, ``"."`` = 15), the ids
    ``composer_core.tasks.tiny.build_char_tokenizer`` gives the same text. Digits are drawn from the first
    ``n_digits`` of 0-9.

    Reward and hint are composer-core's rules on the decoded text (the completion up to its EOS):
    reward = fraction of positions right over ``max(len(completion), length)``; the hinted context is
    the verifier's feedback (the expected digit at every wrong position, ``.`` elsewhere, then ``|``) in
    front of the prompt, and a correct completion has no hint.
    """

    n_digits: int = 10
    length: int = 3
    seed: int = 0

    PAD = PAD_ID
    EOS = EOS_ID
    BOS = BOS_ID

    def __post_init__(self) -> None:
        if not 2 <= self.n_digits <= 10:
            raise ValueError(f"n_digits={self.n_digits}: need 2..10 distinct digits")
        if self.length < 1:
            raise ValueError(f"length={self.length}: need at least 1 digit per prompt")

    @property
    def vocab_size(self) -> int:
        return len(rules.VOCAB)

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def max_new_tokens(self) -> int:
        return self.length + 1

    def prompts(self, n: int, *, step: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        first = rules.VOCAB["0"]
        digits = torch.randint(first, first + self.n_digits, (n, self.length), generator=g)
        end = torch.full((n, 1), rules.VOCAB[">"])
        return torch.cat([digits, end], dim=1)

    def text(self, ids: Tensor) -> str:
        """The task text of token ids (up to the first EOS; pad and bos skipped)."""
        return rules.decode(int(i) for i in ids.tolist())

    def target(self, prompt: Tensor) -> Tensor:
        """The correct completion for one prompt: reversed digits then EOS."""
        return torch.tensor([*rules.encode(rules.oracle_solve(self.text(prompt))), self.EOS])

    def hinted_prompts(
        self, prompts: Tensor, completions: Tensor, completion_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        rows, has_hint = [], []
        for prompt, completion, mask in zip(prompts, completions, completion_mask.bool()):
            text = self.text(prompt)
            hint = rules.feedback_hint(text, self.text(completion[mask]))
            has_hint.append(hint is not None)
            filler = "." * self.length + "|"  # context of a row without a hint (not distilled)
            rows.append(rules.encode(rules.hint_template(text, filler if hint is None else hint)))
        return torch.tensor(rows, dtype=torch.long), torch.tensor(has_hint, dtype=torch.bool)

    def reward(self, prompt: Tensor, completion: Tensor) -> float:
        return rules.verify(self.text(prompt), self.text(completion))
