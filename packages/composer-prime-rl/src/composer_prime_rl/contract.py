"""PRIME-RL's per-sample loss contract: ``LossInputs`` in, ``LossOutputs`` out.

PRIME-RL (``prime_rl.trainer.rl.loss``) calls a custom loss once per packed sample as ``fn(inputs, **kwargs)``.
With ``prime_rl`` importable this module re-exports its dataclasses; otherwise it defines structurally identical
ones (same fields, order, types and defaults). ``ref_logprobs`` was ``teacher_logprobs`` before PRIME-RL commit
0be5ac45 (:func:`read_ref_logprobs` reads either), and ``loss_weights`` was added in that commit (absent: None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

__all__ = ["HAS_PRIME_RL", "LossInputs", "LossOutputs", "read_ref_logprobs"]

try:  # pragma: no cover - exercised only inside a PRIME-RL trainer environment
    from prime_rl.trainer.rl.loss import LossInputs, LossOutputs  # type: ignore[import-not-found, unused-ignore]

    HAS_PRIME_RL = True
except ImportError:
    HAS_PRIME_RL = False

    @dataclass
    class LossInputs:  # type: ignore[no-redef]
        """One sample's 1-D per-token tensors (length ``seq``), as PRIME-RL passes them.

        Attributes:
            trainer_logprobs: log-prob of each sampled token under the policy being trained (with gradient).
            inference_logprobs: log-prob of the same tokens under the inference engine that sampled them.
            ref_logprobs: or None; sampled-token log-probs from a reference scoring (composer: channel 2's
                hinted self-teacher).
            advantages: per-token advantage (group credit broadcast over tokens).
            loss_mask: bool, the tokens that belong to this loss component.
            loss_weights: or None, the component's per-token weight (None = 1.0).
        """

        trainer_logprobs: Tensor
        inference_logprobs: Tensor
        ref_logprobs: Tensor | None
        advantages: Tensor
        loss_mask: Tensor
        loss_weights: Tensor | None = field(default=None)

    @dataclass
    class LossOutputs:  # type: ignore[no-redef]
        """One sample's loss (0-dim, a SUM over its masked tokens) and 0-dim metrics."""

        loss: Tensor
        metrics: dict[str, Tensor]


def read_ref_logprobs(inputs: Any) -> Tensor | None:
    """``inputs.ref_logprobs``, or ``inputs.teacher_logprobs`` on PRIME-RL before 0be5ac45.

    Raises:
        ValueError: both fields are set to different tensors (ambiguous input).
    """
    ref = getattr(inputs, "ref_logprobs", None)
    teacher = getattr(inputs, "teacher_logprobs", None)
    if ref is not None and teacher is not None and ref is not teacher:
        raise ValueError(
            "LossInputs carries both ref_logprobs and teacher_logprobs (its name before PRIME-RL "
            "commit 0be5ac45); pass only ref_logprobs."
        )
    return ref if ref is not None else teacher
