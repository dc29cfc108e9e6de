"""Record the aten operators a block dispatches, to show that a hot path reads nothing back to the host.

On the CPU a forced accelerator path can be checked op by op: an operator in :data:`HOST_READS` would copy a
value (or a data-dependent shape) from the device to the host, a sync on a GPU. Used by composer-core's and the
adapters' device tests::

    with RecordOps() as rec:
        loss = fn(...)
    assert not HOST_READS & set(rec.ops)
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_READS", "RecordOps"]

#: Operators that read a device value (or a data-dependent size) on the host.
HOST_READS = frozenset(
    {
        "aten._local_scalar_dense.default",
        "aten.is_nonzero.default",
        "aten.item.default",
        "aten.nonzero.default",
        "aten.equal.default",
        "aten.allclose.default",
        "aten.masked_select.default",
    }
)


class RecordOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every aten operator dispatched inside the ``with`` block, in order, as ``str(op)`` in :attr:`ops`."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
