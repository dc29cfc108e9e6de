"""Channel 3 for PRIME-RL: ``composer_core.traces.records`` pairs → PRIME-RL training samples.

PRIME-RL calls the loss once per packed sample, so a pairwise DPO/SimPO term cannot be computed there; its loss is
a sum of per-token components (``rl``, ``ce``, ``ref_kl``) routed by weight streams. The pairs are folded into
the data instead: ``mode="ce"`` (default), one sample per pair whose chosen action's tokens get ``ce_weights =
weight`` (supervised replay); ``mode="rl_pair"``, two samples per pair with advantage ``±margin`` on the ``rl``
component, which needs a ``scorer(token_ids) -> list[float]`` (the live policy's log-probs, e.g. PRIME-RL's
``InferencePool.score``). Tokenised with ``composer_core.traces.hints.tokenize_completion``. ``TrainingSample`` is
PRIME-RL's own class when importable, else a structurally identical local dataclass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["HAS_PRIME_RL_TRANSPORT", "TrainingSample", "pair_samples", "records_to_samples"]

try:  # pragma: no cover - exercised only where prime-rl is installed
    from prime_rl.transports.rollouts.types import TrainingSample  # type: ignore[import-not-found, unused-ignore]

    HAS_PRIME_RL_TRANSPORT = True
except ImportError:
    HAS_PRIME_RL_TRANSPORT = False

    @dataclass
    class TrainingSample:  # type: ignore[no-redef]
        """Mirror of PRIME-RL's ``TrainingSample`` (one flat token sequence; all streams share its length)."""

        token_ids: list[int]
        mask: list[bool]
        logprobs: list[float]
        temperatures: list[float]
        env_name: str
        ref_logprobs: list[float] | None = None
        mm_kwargs: dict[str, Any] | None = None
        routed_experts: Any | None = None
        mm_token_type_ids: list[int] | None = None
        rl_weights: list[float] | None = None
        ce_weights: list[float] | None = None
        ref_kl_weights: list[float] | None = None
        advantages: list[float] | None = None


Scorer = Callable[[list[int]], Sequence[float]]


def _tokens(
    tokenizer: Any, record: Any, side: str, chat_template: bool | None
) -> tuple[list[int], list[int]]:
    from composer_core.traces.hints import tokenize_completion
    from composer_core.traces.schema import message_from_dict

    prompt = [message_from_dict(m, f"{record.id}: prompt") for m in record.prompt]
    action = message_from_dict(getattr(record, side)[0], f"{record.id}: {side}")
    return tokenize_completion(tokenizer, prompt, action, record.tools, chat_template=chat_template)


def pair_samples(
    record: Any,
    tokenizer: Any,
    *,
    env_name: str,
    mode: Literal["ce", "rl_pair"] = "ce",
    weight: float = 1.0,
    margin: float = 1.0,
    scorer: Scorer | None = None,
    temperature: float = 1.0,
    chat_template: bool | None = None,
) -> list[TrainingSample]:
    """The PRIME-RL samples of one record's pair (see the module docstring for the two modes)."""
    if not getattr(record, "has_pair", False):
        raise ValueError(f"record {record.id!r} has no pair (chosen/rejected): filter with record.has_pair.")
    if mode not in ("ce", "rl_pair"):
        raise ValueError(f"mode={mode!r} must be 'ce' or 'rl_pair'.")
    if mode == "rl_pair" and scorer is None:
        raise ValueError(
            "mode='rl_pair' needs scorer=: the rl loss needs the sampling log-probs of each trained token "
            "(score the sequence with the live policy, e.g. PRIME-RL's InferencePool.score)."
        )
    out = []
    sides = {"chosen": margin} if mode == "ce" else {"chosen": margin, "rejected": -margin}
    for side, adv in sides.items():
        prompt_ids, action_ids = _tokens(tokenizer, record, side, chat_template)
        ids = prompt_ids + action_ids
        mask = [False] * len(prompt_ids) + [True] * len(action_ids)
        s = TrainingSample(ids, mask, [0.0] * len(ids), [temperature] * len(ids), env_name)
        if mode == "ce":  # supervised replay of the chosen action
            s.rl_weights = [0.0] * len(s.token_ids)
            s.ce_weights = [weight if m else 0.0 for m in s.mask]
        else:
            assert scorer is not None  # checked above
            s.logprobs = [float(x) for x in scorer(list(s.token_ids))]
            if len(s.logprobs) != len(s.token_ids):
                raise ValueError(
                    f"scorer returned {len(s.logprobs)} log-probs for {len(s.token_ids)} tokens."
                )
            s.advantages = [adv if m else 0.0 for m in s.mask]
        out.append(s)
    return out


def records_to_samples(
    records: Iterable[Any] | str | Path,
    tokenizer: Any,
    *,
    env_name: str,
    mode: Literal["ce", "rl_pair"] = "ce",
    **kwargs: Any,
) -> list[TrainingSample]:
    """Every pair of a records file (or iterable of ``TraceRecord``) as PRIME-RL samples (records without a
    pair are skipped). Raises when no record has a pair: a channel that cannot be computed is an error."""
    if isinstance(records, str | Path):
        from composer_core.traces.records import read_records

        records = read_records(records)
    out: list[TrainingSample] = []
    for record in records:
        if getattr(record, "has_pair", False):
            out += pair_samples(record, tokenizer, env_name=env_name, mode=mode, **kwargs)
    if not out:
        raise ValueError("no record carries a pair (chosen/rejected): nothing to replay for channel 3.")
    return out
