"""``Metrics``: a loss's metrics as detached tensors, read from the device only when the caller reads them.

The loss functions never read a metric on the host (each read would be a device sync in the hot loop). A
:class:`Metrics` holds the detached 0-dim tensors (and plain Python numbers); reading a key (``m[k]``,
``float(m[k])``, ``dict(m)``, iterating values) converts **all** of them to floats with one host transfer,
once, and caches the result. :meth:`Metrics.tensors` returns them unread, for callers that reduce or log
tensors themselves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

__all__ = ["Metrics"]


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

    def __getitem__(self, key: str) -> float:
        if key not in self._raw:
            raise KeyError(key)
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, key: object) -> bool:
        return key in self._raw

    def __repr__(self) -> str:
        return f"Metrics({self._read()!r})"
