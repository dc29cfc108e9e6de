"""The task interface the loop runs, and a tiny integer-token task (reverse the digits).

A task turns a step number into prompts, scores completions, and writes the hinted context of the
self-distillation teacher (channel 2: the same model, shown a hint, is the teacher). Prompts are
dense integer tensors of one length: the loop does not left-pad.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
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

    def hinted_prompts(self, prompts: Tensor) -> Tensor:
        """The teacher's context for each prompt: the prompt with a hint, shape [n, P'] (long)."""
        ...

    def reward(self, prompt: Tensor, completion: Tensor) -> float:
        """Reward of one completion (unpadded, shape [t]) for one prompt (shape [P])."""
        ...


@dataclass(frozen=True)
class ReverseDigits:
    """Reverse ``length`` digits, then stop: ``BOS d1 .. dL SEP`` → ``dL .. d1 EOS``.

    Vocabulary: PAD=0, BOS=1, SEP=2, HINT=3, EOS=4, digits 5 .. 5+n_digits-1.
    The hinted context puts the answer in front: ``BOS HINT dL .. d1 SEP d1 .. dL SEP``.
    Reward: the fraction of the L+1 target positions the completion gets right (0 … 1).
    """

    n_digits: int = 8
    length: int = 3
    seed: int = 0

    PAD = 0
    BOS = 1
    SEP = 2
    HINT = 3
    EOS = 4
    FIRST_DIGIT = 5

    def __post_init__(self) -> None:
        if self.n_digits < 2:
            raise ValueError(f"n_digits={self.n_digits}: need at least 2 digits")
        if self.length < 1:
            raise ValueError(f"length={self.length}: need at least 1 digit per prompt")

    @property
    def vocab_size(self) -> int:
        return self.FIRST_DIGIT + self.n_digits

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
        digits = torch.randint(self.FIRST_DIGIT, self.vocab_size, (n, self.length), generator=g)
        bos = torch.full((n, 1), self.BOS)
        sep = torch.full((n, 1), self.SEP)
        return torch.cat([bos, digits, sep], dim=1)

    def target(self, prompt: Tensor) -> Tensor:
        """The correct completion for one prompt: reversed digits then EOS."""
        digits = prompt[1 : 1 + self.length]
        return torch.cat([digits.flip(0), torch.tensor([self.EOS])])

    def hinted_prompts(self, prompts: Tensor) -> Tensor:
        n = prompts.shape[0]
        answers = prompts[:, 1 : 1 + self.length].flip(1)
        head = torch.tensor([self.BOS, self.HINT]).expand(n, 2)
        sep = torch.full((n, 1), self.SEP)
        return torch.cat([head, answers, sep, prompts[:, 1:]], dim=1)

    def reward(self, prompt: Tensor, completion: Tensor) -> float:
        target = self.target(prompt)
        n = min(len(target), len(completion))
        hits = (completion[:n] == target[:n]).sum().item()
        return float(hits) / float(len(target))
