"""The host-side loss: the host's tensors → a :class:`~composer_core.ComposerBatch` → ``compose_loss``.

Keep the translation here and nothing else: the typed config is built once (:mod:`composer_adapter.config`) and
trusted here; tensors are trusted in the hot loop (composer-core checks them).
"""

from __future__ import annotations

from collections.abc import Mapping

from composer_core import ComposeConfig, ComposerBatch, ComposeResult, compose_loss
from torch import Tensor

#: The host's tensor name → the ComposerBatch field (replace with the host's; unnamed fields keep core's name).
HOST_TENSORS: dict[str, str] = {
    "log_prob": "logprobs",
    "old_log_prob": "old_logprobs",
    "ref_log_prob": "ref_logprobs",
    "response_mask": "completion_mask",
}


def to_batch(tensors: Mapping[str, Tensor]) -> ComposerBatch:
    """The host's tensors (its names, or composer-core's for what the host has no name for) as a ComposerBatch."""
    return ComposerBatch(**{HOST_TENSORS.get(name, name): t for name, t in tensors.items()})


def composer_loss(
    tensors: Mapping[str, Tensor],
    config: ComposeConfig,
    *,
    normalizer: float | Tensor | None = None,
    sdpo_normalizer: float | Tensor | None = None,
    replay_normalizer: float | Tensor | None = None,
) -> ComposeResult:
    """``total = w_policy · policy + alpha_sdpo · sdpo + beta_replay · replay`` (composer_core.compose_loss) on the host's
    tensors (``w_policy=0``: pure self-distillation, the policy term not computed).

    The normalisers are the host's global counts (tokens, distilled tokens, pairs over every micro-batch and rank)
    where it has them. Replace with the host's hook (a trainer subclass, a registered loss function, ...); a host
    that scales a channel itself weights them with ``composer_core.loss.compose.weighted_total``.
    """
    norms = {
        "normalizer": normalizer,
        "sdpo_normalizer": sdpo_normalizer,
        "replay_normalizer": replay_normalizer,
    }
    return compose_loss(to_batch(tensors), config, **norms)
