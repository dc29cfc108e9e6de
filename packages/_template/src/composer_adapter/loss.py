"""The host-side loss: translate the host's tensors and config to composer-core, call compose_loss.

Keep the translation here and nothing else: defaults and option checks belong to composer-core (one source
of truth), the host's config is read once at construction, and tensors are trusted in the hot loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from composer_core import ComposerBatch, ComposeResult, compose_loss


def composer_loss(batch: ComposerBatch, options: Mapping[str, Any]) -> ComposeResult:
    """total = policy + alpha_sdpo · sdpo + beta_replay · replay (see composer_core.compose_loss).

    Replace ``batch`` with the host's inputs and build the :class:`ComposerBatch` here.
    """
    return compose_loss(batch, **options)
