"""Collate SDPO records into padded tensors whose completion columns line up (channel 2 input).

Layout (TRL's): prompts are **left**-padded, completions **right**-padded, so in
``cat([prompt, completion], dim=1)`` the completion occupies the same columns in every row,
for the student (``prompt_ids``) and the hinted teacher (``teacher_prompt_ids``) alike::

    student:  [pad pad p p p p | c c c pad]      P = prompt width
    teacher:  [pad p p h h p p p | c c c pad]    P' = teacher prompt width (hint tokens h)

The logits that predict completion token ``t`` sit at column ``P - 1 + t`` (teacher: ``P' - 1 + t``).
:meth:`SDPOBatch.student_inputs` / :meth:`SDPOBatch.teacher_inputs` return the forward inputs (position ids
``cumsum(mask) - 1``, so left padding does not shift positions) and that slice of the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .records import TraceRecord

__all__ = ["ModelInputs", "SDPOBatch", "collate_sdpo", "model_inputs", "pad_ids"]


@dataclass(frozen=True)
class ModelInputs:
    """Forward inputs of one context and the logits columns of the completion."""

    input_ids: torch.Tensor  # [B, P + T]
    attention_mask: torch.Tensor  # [B, P + T]
    position_ids: torch.Tensor  # [B, P + T]
    logits_slice: slice  # logits[:, logits_slice] -> [B, T, V]

    def forward_kwargs(self) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask``, ``position_ids`` for a Hugging Face causal LM."""
        return {k: getattr(self, k) for k in ("input_ids", "attention_mask", "position_ids")}


@dataclass(frozen=True)
class SDPOBatch:
    """Padded SDPO batch. Shapes: prompt ``[B,P]``, teacher prompt ``[B,P']``, completion ``[B,T]``."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    teacher_prompt_ids: torch.Tensor
    teacher_prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    sdpo_mask: torch.Tensor  # bool [B,T]; False on padding
    ids: list[str]

    def student_inputs(self) -> ModelInputs:
        return model_inputs(self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask)

    def teacher_inputs(self) -> ModelInputs:
        return model_inputs(
            self.teacher_prompt_ids, self.teacher_prompt_mask, self.completion_ids, self.completion_mask
        )


def model_inputs(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> ModelInputs:
    """Concatenate a left-padded prompt ``[B,P]`` and a right-padded completion ``[B,T]``."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    p, t = prompt_ids.shape[1], completion_ids.shape[1]
    return ModelInputs(input_ids, attention, position_ids, slice(p - 1, p - 1 + t))


def pad_ids(rows: Sequence[Sequence[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token rows to ``[N, max_len]``; returns ``(ids, mask)`` (long)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        if not r:
            continue
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, sl] = torch.tensor(list(r), dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


def collate_sdpo(
    records: Sequence[TraceRecord], pad_token_id: int, tokenizer: str | None = None
) -> SDPOBatch:
    """Pad the token columns of SDPO records into an :class:`SDPOBatch`; every record needs them, a
    non-empty prompt and the same tokenizer (``tokenizer`` when given)."""
    if not records:
        raise ValueError("records is empty")
    names = {r.tokenizer for r in records}
    for r in records:
        if not r.has_sdpo or r.completion_ids is None or r.prompt_ids is None or r.teacher_prompt_ids is None:
            raise ValueError(
                f"record {r.id} has no SDPO token columns; write records with a tokenizer (--tokenizer)"
            )
        if not r.prompt_ids or not r.teacher_prompt_ids:
            raise ValueError(
                f"record {r.id} has an empty prompt: no logit predicts its first completion token"
            )
    if len(names) != 1 or (tokenizer is not None and names != {tokenizer}):
        raise ValueError(
            f"records were tokenised with {sorted(map(str, names))}, expected one tokenizer {tokenizer!r}"
        )
    prompt, prompt_mask = pad_ids([r.prompt_ids or [] for r in records], pad_token_id, left=True)
    teacher, teacher_mask = pad_ids([r.teacher_prompt_ids or [] for r in records], pad_token_id, left=True)
    completion, completion_mask = pad_ids([r.completion_ids or [] for r in records], pad_token_id, left=False)
    sdpo, _ = pad_ids([r.sdpo_mask or [] for r in records], 0, left=False)
    ids = [r.id for r in records]
    return SDPOBatch(
        prompt, prompt_mask, teacher, teacher_mask, completion, completion_mask, sdpo.bool(), ids
    )
