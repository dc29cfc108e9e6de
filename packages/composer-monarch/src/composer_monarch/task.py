"""The task interface the loop runs, and the digit-reversal task as integer tokens.

A task turns a step number into prompts (dense, one length: the loop does not left-pad), scores
completions, and writes the hinted context of the self-distillation teacher (channel 2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from composer_core.tasks import digit_reversal as rules
from composer_core.tasks.tiny import EOS_ID, PAD_ID
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

    Ids are composer-core's character vocabulary (:data:`composer_core.tasks.digit_reversal.VOCAB`: PAD=0,
    EOS=1, BOS=2, ``"0"``..``"9"`` = 3..12, ``">"`` = 13, ``"|"`` = 14, ``"."`` = 15); digits are drawn from
    the first ``n_digits`` of 0-9. Reward and hint are composer-core's digit-reversal rules (those of
    composer-trl's main job) on the decoded text; a correct completion has no hint.
    """

    n_digits: int = 10
    length: int = 3
    seed: int = 0
    vocab_size: int = field(default=len(rules.VOCAB), init=False, repr=False)
    pad_id: int = field(default=PAD_ID, init=False, repr=False)
    eos_id: int = field(default=EOS_ID, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 2 <= self.n_digits <= 10:
            raise ValueError(f"n_digits={self.n_digits}: need 2..10 distinct digits")
        if self.length < 1:
            raise ValueError(f"length={self.length}: need at least 1 digit per prompt")

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
        return torch.tensor([*rules.encode(rules.oracle_solve(self.text(prompt))), EOS_ID])

    def hinted_prompts(
        self, prompts: Tensor, completions: Tensor, completion_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        pairs = [
            (self.text(p), self.text(c[m])) for p, c, m in zip(prompts, completions, completion_mask.bool())
        ]
        return hinted_rows(pairs, self.length, rules.encode)

    def reward(self, prompt: Tensor, completion: Tensor) -> float:
        return rules.verify(self.text(prompt), self.text(completion))


def hinted_rows(
    pairs: Sequence[tuple[str, str]], length: int, encode: Callable[[str], list[int]]
) -> tuple[Tensor, Tensor]:
    """The hinted contexts of (prompt text, answer text) pairs, encoded by ``encode``, and which rows have a hint:
    composer-core's feedback hint on a wrong answer; a right answer's row gets a filler context (not distilled)."""
    hints = [rules.feedback_hint(text, answer) for text, answer in pairs]
    return _hint_rows([text for text, _ in pairs], hints, "." * length + "|", encode)


def _hint_rows(
    texts: Sequence[str], hints: Sequence[str | None], filler: str, encode: Callable[[str], list[int]]
) -> tuple[Tensor, Tensor]:
    rows = [encode(rules.hint_template(t, filler if h is None else h)) for t, h in zip(texts, hints)]
    has_hint = torch.tensor([h is not None for h in hints], dtype=torch.bool)
    return torch.tensor(rows, dtype=torch.long), has_hint


class EnvBoundTask:
    """A :class:`Task` whose prompts, rewards and hints come from an environment (:mod:`composer_core.envs`).

    ``env`` is a :func:`composer_core.envs.load_env` spec (``"digit-reversal"``, ``"verifiers:<module>"``,
    ``"openenv:<url>"``; ``env_kwargs`` go to its constructor). Text is mapped to ids by ``codec`` (a
    :class:`ReverseDigits`), so the environment must write in that vocabulary, with prompts of one length.
    Prompts: ``n`` of the first ``n_tasks`` train tasks, drawn from ``step``. Reward: one step of a fresh
    episode (:class:`composer_core.envs.EnvScorer`; a multi-turn environment gives its first step's). Hinted
    prompt: that step's ``feedback`` in front of the prompt (no feedback = no hint; one hint length per batch).
    The environment is loaded lazily in each process (it is not pickled).
    """

    def __init__(
        self,
        env: str,
        *,
        codec: ReverseDigits | None = None,
        n_tasks: int = 64,
        seed: int = 0,
        env_kwargs: dict[str, Any] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        if n_tasks < 1:
            raise ValueError(f"n_tasks={n_tasks}: need at least one task")
        self.spec, self.codec, self.n_tasks, self.seed = env, codec or ReverseDigits(), n_tasks, seed
        self.env_kwargs, self.timeout_s = dict(env_kwargs or {}), timeout_s
        self.vocab_size, self.pad_id, self.eos_id = (
            self.codec.vocab_size,
            self.codec.pad_id,
            self.codec.eos_id,
        )
        self._scorer: Any = None
        self._by_prompt: dict[str, str] = {}
        self._ids = torch.empty(0, dtype=torch.long)
        self._answer_len = 0
        self._load()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_scorer": None}

    def _load(self) -> Any:
        if self._scorer is None:
            from composer_core.envs import load_env, scorer_for

            env = load_env(self.spec, **self.env_kwargs)
            self._scorer = scorer_for(env, timeout_s=self.timeout_s)
            tasks = list(env.tasks("train", self.n_tasks))
            self._scorer.register(tasks)
            prompts = [self._prompt_text(t) for t in tasks]
            self._by_prompt = {p: t.task_id for p, t in zip(prompts, tasks)}
            if len({len(p) for p in prompts}) != 1:
                raise ValueError(f"env {self.spec!r}: prompts differ in length; the loop does not left-pad")
            # every prompt is in the codec's vocabulary (encode raises naming the characters)
            self._ids = torch.tensor([rules.encode(p) for p in prompts], dtype=torch.long)
            refs = [t.reference for t in tasks if t.reference is not None]
            self._answer_len = max((len(r) for r in refs), default=self.codec.length)
        return self._scorer

    def _prompt_text(self, task: Any) -> str:
        from composer_core.envs import prompt_messages

        messages = prompt_messages(task)
        if len(messages) != 1 or messages[0].role != "user":
            raise ValueError(f"env {self.spec!r}: task {task.task_id!r} has a chat prompt, need text")
        return str(messages[0].text)

    @property
    def max_new_tokens(self) -> int:
        return self._answer_len + 1

    def prompts(self, n: int, *, step: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return self._ids[torch.randint(0, len(self._ids), (n,), generator=g)]

    def step(self, prompt: Tensor, completion: Tensor) -> Any:
        """The environment's :class:`~composer_core.envs.StepResult` for one completion of one prompt."""
        text = self.codec.text(prompt)
        task_id = self._by_prompt.get(text)
        if task_id is None:
            raise ValueError(f"env {self.spec!r}: prompt {text!r} is none of its tasks")
        return self._load().score(task_id, self.codec.text(completion))

    def reward(self, prompt: Tensor, completion: Tensor) -> float:
        return float(self.step(prompt, completion).reward)

    def hinted_prompts(
        self, prompts: Tensor, completions: Tensor, completion_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        texts, hints = [], []
        for prompt, completion, mask in zip(prompts, completions, completion_mask.bool()):
            texts.append(self.codec.text(prompt))
            fb = self.step(prompt, completion[mask]).feedback
            hints.append(fb if fb and fb.strip() else None)
        lengths = {len(h) for h in hints if h is not None}
        if len(lengths) > 1:
            raise ValueError(f"env {self.spec!r}: feedback lengths {sorted(lengths)} in one batch; need one")
        width = lengths.pop() if lengths else self._answer_len + 1
        return _hint_rows(texts, hints, "." * (width - 1) + "|", rules.encode)
