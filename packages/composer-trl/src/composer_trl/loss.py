"""The adapter's loss assembly: a filled :class:`~composer_core.loss.compose.ComposerBatch` + the TRL config → loss.

Pure (no model, no trainer), so the trainer's ``_compute_loss`` and the core conformance suite
(``tests/test_conformance.py``) run the very same code.

Normalisation follows TRL 1.16 for channel 1 and TRL's ``dapo`` convention for channels 2 and 3::

    dapo/cispo/vespo  Σ L·m / (num_items / P · G / S)    (train; num_items over the generation batch)
    other types       compose_loss's local value         (the whole objective then / G in train)
    sdpo, replay    Σ / (count / P · G / S)              (count = hinted tokens / pairs; other types: no G)

with P processes, G = current gradient-accumulation steps and S = steps per generation (in eval G = S = 1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from composer_core.loss.compose import ComposerBatch, ComposeResult, compose_loss
from composer_core.loss.config import TAID, ComposeConfig
from torch import Tensor


@dataclass(frozen=True)
class Counts:
    """Global counts over the generation batch (all processes) and the accumulation layout."""

    num_items: Tensor | None = None  # TRL's num_items_in_batch (active completion tokens)
    sdpo_items: Tensor | None = None  # hinted completion tokens
    replay_items: Tensor | None = None  # preference pairs
    num_processes: int = 1
    accumulation: int = 1  # current gradient-accumulation steps (1 in eval)
    steps_per_generation: int = 1  # micro-batches per generation batch (1 in eval)


#: TRL's loss types normalised by the generation batch's token count (``num_items_in_batch``), not per micro-batch.
WINDOW_LOSS_TYPES = ("dapo", "cispo", "vespo")


def _window(count: Tensor | None, c: Counts, accumulation: int) -> Tensor | None:
    if count is None:
        return None
    norm = count.clamp(min=1) / c.num_processes
    if accumulation != 1 or c.steps_per_generation != 1:
        norm = norm * accumulation / c.steps_per_generation
    return norm


def composer_trl_loss(
    batch: ComposerBatch, config: ComposeConfig, counts: Counts, *, taid_now: float | None = None
) -> tuple[Tensor, ComposeResult]:
    """``loss = w_policy · policy + alpha_sdpo · sdpo + beta_replay · replay`` for one micro-batch, weighted once,
    by :func:`~composer_core.loss.compose.compose_loss`.

    ``config`` is the trainer's :class:`~composer_core.loss.config.ComposeConfig`. TRL divides the loss of a
    per-micro-batch loss type (grpo, bnpo, dr_grpo, ...) by the accumulation steps G: composer divides the whole
    objective, its sdpo and replay normalisers then spanning processes and steps per generation but not G (so
    each channel still weighs Σ / its global count). Returns the loss to backpropagate and the
    :class:`~composer_core.loss.compose.ComposeResult` whose ``total``, ``policy``, ``sdpo`` and ``replay`` are
    the loss's terms (unweighted channel values on that same scale). ``taid_now``: TAID's interpolation t at this
    step (its schedule moves it every optimiser step; the option ``taid_t`` is where it starts).
    """
    window = config.policy.loss_type in WINDOW_LOSS_TYPES
    span = counts.accumulation if window else 1  # the accumulation steps the normalisers span
    if isinstance(config.sdpo.wrapper, TAID):  # TAID's t moves every optimiser step
        config = replace(config, sdpo=replace(config.sdpo, wrapper=replace(config.sdpo.wrapper, t=taid_now)))
    result = compose_loss(
        batch,
        config,
        # TRL 1.16's exact expression: num_items_in_batch.clamp(min=1) / P, then × G / S in training.
        normalizer=_window(counts.num_items, counts, span) if window else None,
        sdpo_normalizer=_window(counts.sdpo_items, counts, span),
        replay_normalizer=_window(counts.replay_items, counts, span),
    )
    g = counts.accumulation // span
    if g != 1:  # TRL's per-micro-batch loss types: loss / G
        p, s, r = (None if v is None else v / g for v in (result.policy, result.sdpo, result.replay))
        result = replace(result, total=result.total / g, policy=p, sdpo=s, replay=r)
    return result.total, result
