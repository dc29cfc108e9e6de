"""Collate preference records into padded chosen/rejected tensors and sum their log-probs (channel 3 input).

The DPO / SimPO losses (:mod:`composer_core.loss.preference`) take **summed** completion log-probs
``ℓ^w = Σ_t log πθ(y^w_t | x, y^w_<t)`` and ``ℓ^l`` of the chosen and rejected actions at the same state
``x``, plus their token counts. :func:`collate_pairs` tokenises like the SDPO side
(:func:`composer_core.traces.hints.tokenize_completion`) and pads like :mod:`composer_core.traces.sdpo_batch`;
:func:`sequence_logps` turns logits into the summed log-probs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .hints import tokenize_completion
from .records import TraceRecord
from .schema import message_from_dict
from .sdpo_batch import ModelInputs, model_inputs, pad_ids

__all__ = ["PairBatch", "collate_pairs", "sequence_logps"]


@dataclass(frozen=True)
class PairBatch:
    """P pairs. ``chosen_ids [P,Tc]``, ``rejected_ids [P,Tr]`` right-padded; prompts left-padded."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    chosen_ids: torch.Tensor
    chosen_mask: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_mask: torch.Tensor
    chosen_lengths: torch.Tensor  # [P] long
    rejected_lengths: torch.Tensor  # [P] long
    ref_chosen_logps: torch.Tensor | None  # [P] float64 when every record carries them
    ref_rejected_logps: torch.Tensor | None
    ids: list[str]

    def chosen_inputs(self) -> ModelInputs:
        return model_inputs(self.prompt_ids, self.prompt_mask, self.chosen_ids, self.chosen_mask)

    def rejected_inputs(self) -> ModelInputs:
        return model_inputs(self.prompt_ids, self.prompt_mask, self.rejected_ids, self.rejected_mask)


def sequence_logps(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``ℓ_i = Σ_t m_it · log softmax(z_it)[y_it]`` — summed completion log-probs ``[P]``.

    ``logits [P,T,V]`` are the rows that predict ``ids [P,T]`` (``logits[:, inputs.logits_slice]``); computed in
    ``promote(logits.dtype, float32)``.
    """
    if logits.dim() != 3 or logits.shape[:2] != ids.shape or ids.shape != mask.shape:
        raise ValueError(
            f"logits must be [P,T,V] and ids/mask [P,T]; got {tuple(logits.shape)}, {tuple(ids.shape)}, "
            f"{tuple(mask.shape)}"
        )
    if not torch.isfinite(logits).all():
        raise ValueError("logits contain NaN or inf")
    cdtype = torch.promote_types(logits.dtype, torch.float32)  # bf16/fp16 -> float32; float64 stays
    logp = torch.log_softmax(logits.to(cdtype), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return (logp * mask.to(logp.dtype)).sum(dim=-1)


def collate_pairs(
    records: Sequence[TraceRecord],
    tokenizer: Any,
    *,
    pad_token_id: int | None = None,
    chat_template: bool | None = None,
) -> PairBatch:
    """Tokenise and pad the pairs of ``records`` (those without ``chosen`` raise ``ValueError``)."""
    if not records:
        raise ValueError("records is empty")
    pad = pad_token_id if pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        raise ValueError("the tokenizer has no pad_token_id; pass pad_token_id=")
    prompts, chosen, rejected = [], [], []
    for r in records:
        if r.chosen is None or r.rejected is None:
            raise ValueError(f"record {r.id} has no preference pair (chosen/rejected)")
        prompt = [message_from_dict(m, f"record {r.id} prompt") for m in r.prompt]
        c = message_from_dict(r.chosen[0], f"record {r.id} chosen")
        j = message_from_dict(r.rejected[0], f"record {r.id} rejected")
        p_ids, c_ids = tokenize_completion(tokenizer, prompt, c, r.tools, chat_template=chat_template)
        _, j_ids = tokenize_completion(tokenizer, prompt, j, r.tools, chat_template=chat_template)
        if not p_ids:
            raise ValueError(
                f"record {r.id} has an empty prompt: no logit predicts its first completion token"
            )
        prompts.append(p_ids)
        chosen.append(c_ids)
        rejected.append(j_ids)
    prompt_ids, prompt_mask = pad_ids(prompts, pad, left=True)
    chosen_ids, chosen_mask = pad_ids(chosen, pad, left=False)
    rejected_ids, rejected_mask = pad_ids(rejected, pad, left=False)
    refs = [(r.ref_chosen_logp, r.ref_rejected_logp) for r in records]
    have_refs = all(None not in p for p in refs)
    ref_c, ref_r = torch.tensor(list(zip(*refs)), dtype=torch.float64) if have_refs else (None, None)
    pairs = (prompt_ids, prompt_mask, chosen_ids, chosen_mask, rejected_ids, rejected_mask)
    lengths = (chosen_mask.sum(dim=1), rejected_mask.sum(dim=1))
    return PairBatch(*pairs, *lengths, ref_c, ref_r, [r.id for r in records])
