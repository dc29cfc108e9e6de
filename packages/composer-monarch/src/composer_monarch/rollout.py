"""The data that travels between actors, and sampling with the current policy.

Everything here is a dataclass of CPU tensors: Monarch pickles it between processes (and hosts).
Groups are contiguous: rows ``g*G .. g*G+G-1`` are the G samples of prompt g.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from composer_monarch.model import forward_logits, token_logprobs


@dataclass(frozen=True)
class Rollout:
    """Completions sampled by the generator for one step.

    prompt_ids [B, P] long; completion_ids [B, T] long (``pad_id`` after the end);
    completion_mask [B, T] bool; inference_logprobs [B, T] float (sampler's log-probabilities of the
    sampled tokens, the behaviour policy); ``policy_version`` = number of optimiser steps of the weights
    that sampled it; ``group_size`` samples per prompt, contiguous.
    """

    step: int
    prompt_ids: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    inference_logprobs: Tensor
    policy_version: int
    group_size: int


@dataclass(frozen=True)
class PreferencePairs:
    """Channel-3 pairs: a chosen (a teacher's replayed action) and a rejected (the student's) completion.

    prompt_ids [P, L] long; chosen_ids / rejected_ids [P, T'] long, padded; chosen_mask /
    rejected_mask [P, T'] bool; ``sources`` names the teacher behind each chosen completion.
    """

    prompt_ids: Tensor
    chosen_ids: Tensor
    chosen_mask: Tensor
    rejected_ids: Tensor
    rejected_mask: Tensor
    sources: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])


@dataclass(frozen=True)
class TrainBatch:
    """One training step's inputs for the trainer.

    Channel 1: prompt_ids, completion_ids, completion_mask, advantages [B], inference_logprobs [B, T]
    (the sampler's log-probabilities; they are the ``old_logprobs`` of the clipped ratio, so a batch
    sampled by older weights, as with overlap, is corrected by importance ratios).
    Channel 2: teacher_logits [B, T, V] — the hinted-context teacher at the completion positions;
    sdpo_rows [B] bool — the completions that have a hint and are distilled (None: all of them);
    teacher_key — on the mesh the logits stay on the teacher actor under this key and the trainer takes
    them from there (teacher_logits is None until then), so they never pass through the driver.
    Channel 3: pairs — replayed teacher actions that beat the student's.
    """

    step: int
    prompt_ids: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    advantages: Tensor
    inference_logprobs: Tensor
    rewards: Tensor
    policy_version: int
    teacher_logits: Tensor | None = None
    pairs: PreferencePairs | None = None
    sdpo_rows: Tensor | None = None
    teacher_key: str | None = None


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt_ids: Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample one completion per row with ancestral sampling from softmax(logits / temperature).

    Returns completion_ids [B, T] (``pad_id`` after EOS), completion_mask [B, T] (True up to and
    including EOS) and the log-probabilities of the sampled tokens [B, T] (0 where masked).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (greedy decoding is not sampling)")
    tokens, done = prompt_ids, torch.zeros(prompt_ids.shape[0], dtype=torch.bool)
    ids, masks, logps = [], [], []
    for _ in range(max_new_tokens):
        logits = forward_logits(model, tokens)[:, -1].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)
        lp = token_logprobs(logits.unsqueeze(1), nxt.unsqueeze(1)).squeeze(1)
        ids.append(nxt.masked_fill(done, pad_id))
        masks.append(~done)
        logps.append(lp.masked_fill(done, 0.0))
        done = done | (nxt == eos_id)
        tokens = torch.cat([tokens, ids[-1].unsqueeze(1)], dim=1)
        if bool(done.all()):
            break
    return torch.stack(ids, 1), torch.stack(masks, 1), torch.stack(logps, 1)


def pad_right(rows: list[Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    """Stack 1-D long tensors of varying length (at least one) into [N, max_len] plus a bool mask."""
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
        mask[i, : len(r)] = True
    return out, mask


def assemble_batch(
    rollout: Rollout,
    rewards: Tensor,
    *,
    advantage_scale: str = "group",
    pairs: PreferencePairs | None = None,
    sdpo_rows: Tensor | None = None,
    teacher_key: str | None = None,
) -> TrainBatch:
    """The trainer's batch from a scored rollout: GRPO group advantages (composer_core) + annotations.

    A_i = (r_i − mean_g) / (std_g + eps) with ``advantage_scale="group"``; "batch" uses the batch std;
    "none" is Dr. GRPO's r_i − mean_g (see ``composer_core.loss.advantages.group_advantages``).
    """
    from composer_core.loss.advantages import group_advantages

    if rewards.shape != (rollout.prompt_ids.shape[0],):
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)}; expected one reward per completion "
            f"({rollout.prompt_ids.shape[0]},)"
        )
    if sdpo_rows is not None and (teacher_key is None or sdpo_rows.shape != rewards.shape):
        raise ValueError(
            f"sdpo_rows (shape {tuple(sdpo_rows.shape)}) needs teacher_key and one flag per completion "
            f"({rewards.shape[0]},)"
        )
    adv = group_advantages(rewards, rollout.group_size, scale=advantage_scale)  # type: ignore[arg-type]
    r, rows = rollout, None if sdpo_rows is None else sdpo_rows.bool()
    sampled = (r.step, r.prompt_ids, r.completion_ids, r.completion_mask, adv, r.inference_logprobs, rewards)
    return TrainBatch(*sampled, r.policy_version, pairs=pairs, sdpo_rows=rows, teacher_key=teacher_key)
