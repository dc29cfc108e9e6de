"""The adapter's loss assembly: a filled :class:`~composer_core.loss.compose.ComposerBatch` + the TRL config → loss.

Pure (no model, no trainer), so the trainer's ``_compute_loss`` and the core conformance suite
(:func:`conformance_compute`) run the very same code.

Normalisation follows TRL 1.16 for channel 1 and TRL's ``dapo`` convention for channels 2 and 3::

    dapo/cispo/vespo  Σ L·m / (num_items / P · G / S)    (train; num_items over the generation batch)
    other types       compose_loss's local value / G     (train)
    sdpo, replay    Σ / (count / P · G / S)              (count = hinted tokens / pairs, generation batch)

with P processes, G = current gradient-accumulation steps and S = steps per generation (in eval G = S = 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from composer_core.loss.compose import ComposerBatch, ComposeResult, compose_loss, weighted_total
from composer_core.loss.config import TAID
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


def _window(count: Tensor | None, c: Counts) -> Tensor | None:
    if count is None:
        return None
    norm = count.clamp(min=1) / c.num_processes
    if c.accumulation != 1 or c.steps_per_generation != 1:
        norm = norm * c.accumulation / c.steps_per_generation
    return norm


def composer_trl_loss(
    batch: ComposerBatch, args: Any, counts: Counts, *, taid_t: float | None = None
) -> tuple[Tensor, ComposeResult]:
    """``loss = w_policy · policy (TRL-scaled) + alpha_sdpo · sdpo + beta_replay · replay`` for one micro-batch.

    ``args`` is a :class:`~composer_trl.ComposerGRPOConfig`. Returns the loss to backpropagate and the
    :class:`~composer_core.loss.compose.ComposeResult` (unweighted channel values and metrics).
    """
    # TRL 1.16's exact expression: num_items_in_batch.clamp(min=1) / P, then × G / S in training.
    policy_norm = _window(counts.num_items, counts) if args.loss_type in WINDOW_LOSS_TYPES else None
    config = args.compose_config  # built and validated with the TRL config (cached per option values)
    if isinstance(config.sdpo.wrapper, TAID):  # TAID's t moves every optimiser step
        config = replace(config, sdpo=replace(config.sdpo, wrapper=replace(config.sdpo.wrapper, t=taid_t)))
    result = compose_loss(
        batch,
        config,
        normalizer=policy_norm,
        sdpo_normalizer=_window(counts.sdpo_items, counts),
        replay_normalizer=_window(counts.replay_items, counts),
    )
    policy, sdpo, replay = channel_terms(result, args, counts)
    if policy is None and sdpo is None and replay is None:  # w_policy=0, nothing distilled here
        return result.total, result
    return weighted_total(policy, sdpo, replay, args.alpha_sdpo, args.beta_replay, args.w_policy), result


def channel_terms(
    result: ComposeResult, args: Any, counts: Counts
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The policy term as TRL scales it (None: ``w_policy=0`` skipped it), and the unweighted sdpo and replay
    losses (None: skipped)."""
    # TRL divides grpo/bnpo/dr_grpo by the accumulation steps; dapo's normaliser already spans the window.
    policy = result.policy
    if policy is not None and args.loss_type not in WINDOW_LOSS_TYPES:
        policy = policy / counts.accumulation
    return policy, result.sdpo, result.replay


# ----------------------------------------------------------------------------- core conformance suite

CONFORMANCE_SUPPORTS = frozenset(
    {
        "policy",
        "sdpo_full",
        "sdpo_sampled",
        "sdpo_topk",
        "sdpo_compiled",
        "taid",
        "entropy_opd",
        "dpo",
        "simpo",
        "global_normalizer",
    }
)
"""Conformance tags this adapter implements."""

_RENAMED = {"epsilon_low": "epsilon", "kl_beta": "beta"}


def conformance_compute(batch: ComposerBatch, options: Mapping[str, Any]) -> Tensor:
    """Host-side path for :func:`composer_core.testing.check_adapter`: compose_loss options → a
    ``ComposerGRPOConfig`` → :func:`composer_trl_loss` (one process, no accumulation).

    Global normalisers map to the counts the trainer gathers (``normalizer`` → TRL's
    ``num_items_in_batch``, ``sdpo_normalizer`` → hinted tokens, ``replay_normalizer`` → pairs).
    """
    import dataclasses
    import tempfile

    from composer_trl.config import ComposerGRPOConfig

    same = {f.name for f in dataclasses.fields(ComposerGRPOConfig)}

    kwargs: dict[str, Any] = {"alpha_sdpo": 1.0, "beta_replay": 1.0}
    counts: dict[str, Tensor] = {}
    taid_t: float | None = None
    for key, value in options.items():
        if key in _RENAMED:
            kwargs[_RENAMED[key]] = value
        elif key == "sdpo_form":
            if value not in ("sampled", "full", "topk", "auto"):
                raise ValueError(
                    f"sdpo_form={value!r} is not a ComposerGRPOConfig option (full|sampled|topk)."
                )
            kwargs["sdpo_form"] = "full" if value == "auto" else value
        elif key == "taid_t":
            taid_t = float(value)
        elif key in ("normalizer", "sdpo_normalizer", "replay_normalizer"):
            counts[key] = torch.as_tensor(float(value), dtype=torch.float64)
        elif key in same:  # the same name here as in compose_loss
            kwargs[key] = value
        else:
            raise ValueError(f"compose_loss option {key!r} has no ComposerGRPOConfig counterpart.")
    if kwargs.get("beta", 0.0) != 0.0:
        kwargs["use_bias_correction_kl"] = False
    if kwargs.get("sdpo_wrapper") == "taid":
        kwargs["max_steps"] = 1000
    if "normalizer" in counts and kwargs.get("loss_type", "dapo") != "dapo":
        raise ValueError(
            "a global policy normalizer maps to TRL's num_items_in_batch, i.e. loss_type='dapo'."
        )
    with tempfile.TemporaryDirectory() as tmp:
        args = ComposerGRPOConfig(
            output_dir=tmp,
            report_to="none",
            use_cpu=True,
            max_completion_length=batch.logprobs.shape[1],
            **kwargs,
        )
    c = Counts(
        num_items=counts.get("normalizer"),
        sdpo_items=counts.get("sdpo_normalizer"),
        replay_items=counts.get("replay_normalizer"),
    )
    loss, _ = composer_trl_loss(batch, args, c, taid_t=taid_t)
    return loss
