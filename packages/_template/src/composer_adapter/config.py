"""The host's options → composer-core's typed :class:`~composer_core.ComposeConfig`, built once at construction.

Keep the host's own names where the host already has one (``HOST_NAMES``); every other composer option travels in
one ``composer`` section under composer-core's own names. Defaults and value checks are composer-core's alone: this
module declares no default and checks nothing itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from composer_core import ComposeConfig

#: The host's name → composer-core's flat name, for the options the host already has (replace with the host's).
HOST_NAMES: dict[str, str] = {
    "clip_ratio_low": "epsilon_low",
    "clip_ratio_high": "epsilon_high",
    "kl_coef": "kl_beta",
    "loss_agg_mode": "loss_type",
}


def compose_config(host: Mapping[str, Any], composer: Mapping[str, Any]) -> ComposeConfig:
    """One :class:`ComposeConfig` from the host's options (its names; others ignored) and the ``composer`` section
    (composer-core's names). A bad value raises ``ValueError`` naming the option, once, here."""
    flat = {core: host[name] for name, core in HOST_NAMES.items() if name in host}
    clash = sorted(set(flat) & set(composer))
    if clash:
        raise ValueError(
            f"{clash} set both in the host's config and in the composer section; keep the host's."
        )
    return ComposeConfig.from_flat(**flat, **composer)


def split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """composer-core's flat options → (host options under the host's names, the composer section): the inverse of
    :func:`compose_config`, used by the conformance test to drive the host's path."""
    to_host = {core: name for name, core in HOST_NAMES.items()}
    host = {to_host[k]: v for k, v in options.items() if k in to_host}
    return host, {k: v for k, v in options.items() if k not in to_host}
