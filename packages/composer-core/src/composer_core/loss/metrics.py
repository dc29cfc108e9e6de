"""``Metrics``: a loss's metrics as detached tensors, read from the device only when the caller reads them.

Reading a key converts **all** of them to floats with one host transfer, once; :meth:`Metrics.tensors` returns
them unread. :data:`METRIC_KEYS` names every key :func:`composer_core.compose_loss` can return
(``<group>/<name>``), the one source of truth adapters log under their ``composer/`` prefix.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import torch
from torch import Tensor

__all__ = ["ADAPTER_PREFIX", "GRAD_NORM_KEYS", "METRIC_KEYS", "OPTIONAL_METRIC_KEYS", "Metrics"]

#: Every metric key of :func:`composer_core.compose_loss` -> what it holds. A full 3-channel batch with the
#: default options returns exactly the keys not in :data:`OPTIONAL_METRIC_KEYS`.
METRIC_KEYS: Mapping[str, str] = MappingProxyType(
    {
        "loss/total": "the total loss, w_policy*policy + alpha_sdpo*sdpo + beta_replay*replay",
        "loss/policy": "channel 1 (policy) loss before w_policy; absent when the channel was skipped (w_policy=0)",
        "policy/skipped": "1.0 when channel 1 was not computed (w_policy=0 only: pure self-distillation)",
        "loss/sdpo": "channel 2 (SDPO) loss before alpha_sdpo; absent when the channel was skipped",
        "loss/replay": "channel 3 (trace replay) loss before beta_replay; absent when the channel was skipped",
        "policy/clip_ratio": "fraction of policy tokens whose ratio was clipped",
        "policy/kl": "mean per-token KL to the reference (kl_beta != 0 only)",
        "policy/rollout_is_weight": "mean rollout IS weight (rollout correction or rollout_is_weights only)",
        "policy/dppo_masked": "fraction of tokens the DPPO mask dropped (rollout_correction='dppo_mask' only)",
        "sdpo/skipped": "1.0 when channel 2 was not computed (inputs absent or alpha_sdpo=0), else 0.0",
        "sdpo/tokens": "distilled tokens of this call; absent when the channel was skipped",
        "taid/t": "TAID's interpolation t of this step (sdpo_wrapper='taid' only)",
        "replay/skipped": "1.0 when channel 3 was not computed (inputs absent or beta_replay=0), else 0.0",
        "replay/pairs": "preference pairs of this call; absent when the channel was skipped",
        "replay/accuracy": "fraction of pairs with a positive preference margin; absent when skipped",
        "grad_norm/policy": "adapters, at logging steps: L2 norm of the policy term's gradient (before clipping)",
        "grad_norm/sdpo": "adapters, at logging steps: L2 norm of alpha_sdpo*sdpo's gradient (0 when skipped)",
        "grad_norm/replay": "adapters, at logging steps: L2 norm of beta_replay*replay's gradient (0 when skipped)",
    }
)

#: The per-channel gradient norms an adapter logs (never returned by ``compose_loss``: it has no parameters).
GRAD_NORM_KEYS = frozenset({"grad_norm/policy", "grad_norm/sdpo", "grad_norm/replay"})

#: Keys present only under an option (see :data:`METRIC_KEYS`).
OPTIONAL_METRIC_KEYS = (
    frozenset({"policy/skipped", "policy/kl", "policy/rollout_is_weight", "policy/dppo_masked", "taid/t"})
    | GRAD_NORM_KEYS
)

#: The prefix under which every adapter logs :data:`METRIC_KEYS` (``composer/loss/sdpo``); an adapter's own
#: counters use the same ``<group>/<name>`` grouping under it (``composer/sdpo/hinted_rows``).
ADAPTER_PREFIX = "composer/"

#: Keys renamed when the channels got their names (policy, sdpo, replay): old -> new. Reading an old key
#: still works, with a DeprecationWarning.
_RENAMED = {"skipped/sdpo": "sdpo/skipped", "skipped/replay": "replay/skipped"}


class Metrics(Mapping[str, float]):
    """Read-only mapping ``name -> float``, converted lazily (one host sync for all keys) from tensors."""

    __slots__ = ("_floats", "_raw")

    def __init__(self, raw: Mapping[str, Tensor | float] | None = None) -> None:
        self._raw: dict[str, Tensor | float] = dict(raw or {})
        self._floats: dict[str, float] | None = None

    def tensors(self) -> dict[str, Tensor | float]:
        """The metrics unread: detached 0-dim tensors (and Python numbers), no host sync."""
        return dict(self._raw)

    def _read(self) -> dict[str, float]:
        if self._floats is None:
            keys = [k for k, v in self._raw.items() if isinstance(v, Tensor)]
            floats = {k: float(v) for k, v in self._raw.items() if not isinstance(v, Tensor)}
            if keys:
                tensors = [self._raw[k] for k in keys]
                device = tensors[0].device  # type: ignore[union-attr]
                stacked = torch.stack([t.detach().to(device, torch.float64).reshape(()) for t in tensors])  # type: ignore[union-attr]
                floats.update(zip(keys, stacked.tolist()))
            self._floats = {k: floats[k] for k in self._raw}
        return self._floats

    def _key(self, key: object) -> object:
        """``key``, or the new name of a renamed key (with a DeprecationWarning)."""
        if isinstance(key, str) and key not in self._raw and _RENAMED.get(key) in self._raw:
            warnings.warn(
                f"metric key {key!r} is deprecated; use {_RENAMED[key]!r} (keys are <group>/<name>, see "
                "composer_core.METRIC_KEYS).",
                DeprecationWarning,
                stacklevel=3,
            )
            return _RENAMED[key]
        return key

    def __getitem__(self, key: str) -> float:
        key = str(self._key(key))
        if key not in self._raw:
            raise KeyError(key)
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, key: object) -> bool:
        return self._key(key) in self._raw

    def __repr__(self) -> str:
        return f"Metrics({self._read()!r})"
