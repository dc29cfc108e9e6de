"""Weights as one packed byte buffer: the trainer → generator/teacher push, never through the driver.

The trainer packs its state dict into one ``uint8`` buffer (8-byte aligned offsets, tied weights once),
described by a :class:`WeightLayout`; receivers copy the bytes into their own parameters, bitwise. Over
``"rdma"`` each receiver reads the trainer's Monarch ``RDMABuffer`` (ibverbs, or Monarch's TCP transport);
over ``"shm"`` receivers on the trainer's host map its ``/dev/shm`` buffer (unlinked once all have mapped
it); ``"direct"`` sends the buffer in one actor-to-actor message. The driver only sees the receipt.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

TRANSPORTS = ("auto", "shm", "rdma", "direct")
_ALIGN = 8


@dataclass(frozen=True)
class Slot:
    """Where one state-dict entry lives in the packed buffer (bytes ``offset .. offset+nbytes``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class WeightLayout:
    """The packed buffer's table of contents; tied entries share one ``offset``."""

    slots: tuple[Slot, ...]
    nbytes: int


def layout_of(state: Mapping[str, Tensor]) -> WeightLayout:
    """Layout of ``state``: one aligned segment per distinct tensor (tied weights once)."""
    slots: list[Slot] = []
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], int] = {}
    end = 0
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.stride(), t.dtype)
        nbytes = t.numel() * t.element_size()
        if key in seen and nbytes:
            offset = seen[key]
        else:
            offset = end
            seen[key] = offset
            end = offset + -(-nbytes // _ALIGN) * _ALIGN
        slots.append(Slot(name, t.dtype, tuple(t.shape), offset, nbytes))
    return WeightLayout(tuple(slots), max(end, _ALIGN))


def view(flat: Tensor, slot: Slot) -> Tensor:
    """The tensor of ``slot`` as a view into the packed ``uint8`` buffer."""
    return flat[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def pack_into(state: Mapping[str, Tensor], layout: WeightLayout, flat: Tensor) -> None:
    """Copy ``state`` into ``flat`` (``uint8``, ``layout.nbytes`` long) at the layout's offsets."""
    done: set[int] = set()
    with torch.no_grad():
        for slot in layout.slots:
            if slot.offset in done and slot.nbytes:
                continue
            done.add(slot.offset)
            view(flat, slot).copy_(state[slot.name].detach())


def unpack_into(model: nn.Module, layout: WeightLayout, flat: Tensor, who: str) -> None:
    """Copy the packed weights into ``model``'s parameters and buffers (bitwise, in place).

    Raises ValueError naming ``who`` when the layout does not fit the model (another model factory?).
    """
    state = model.state_dict()
    names = {s.name for s in layout.slots}
    if set(state) != names:
        missing, unexpected = sorted(set(state) - names), sorted(names - set(state))
        raise ValueError(
            f"{who}: the weights do not fit its model (same model factory?): missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for slot in layout.slots:
        dst = state[slot.name]
        if tuple(dst.shape) != slot.shape or dst.dtype != slot.dtype:
            raise ValueError(
                f"{who}: the weights do not fit its model (same model factory?): {slot.name} is "
                f"{slot.dtype}{list(slot.shape)} in the trainer, {dst.dtype}{list(dst.shape)} here"
            )
    with torch.no_grad():
        for slot in layout.slots:
            state[slot.name].copy_(view(flat, slot))


def host_id() -> str:
    """This machine's identity for the same-host check (hostname + boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shared_buffer(nbytes: int) -> tuple[str, Tensor]:
    """A new ``uint8`` tensor of ``nbytes`` backed by a shared-memory file; returns (path, tensor)."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(root, f"composer-weights-{uuid.uuid4().hex}.bin")
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return path, torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def resolve_transport(transport: str, same_host: bool = False) -> str:
    """'auto' → 'shm' when every receiver shares the trainer's host, else 'rdma' where Monarch has an RDMA
    backend, else 'direct'; checks the name (and that 'shm' / 'rdma' are possible)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"weight_transport={transport!r}: use one of {list(TRANSPORTS)}")
    if transport == "shm" and not same_host:
        raise ValueError(
            "weight_transport='shm' needs every receiver on the trainer's host: use 'auto' or 'rdma'"
        )
    if transport == "auto" and same_host:
        return "shm"
    if transport in ("direct", "shm"):
        return transport
    from monarch.rdma import get_rdma_backend

    available = str(get_rdma_backend()) != "none"
    if transport == "rdma" and not available:
        raise ValueError(
            "weight_transport='rdma' but Monarch has no RDMA backend here: use 'auto' or 'direct', or "
            "enable Monarch's TCP transport (monarch.configure(rdma_allow_tcp_fallback=True))"
        )
    return "rdma" if available else "direct"


class WeightReceiver:
    """A receiver's side of the push: one reusable receive buffer, unpacked into ``model``."""

    def __init__(self, model: nn.Module, who: str) -> None:
        self.model = model
        self.who = who
        self._recv: Tensor | None = None
        self._shared: tuple[str, Tensor] | None = None  # the trainer's shared buffer, mapped

    def pull(self, layout: WeightLayout, source: object, timeout_s: float) -> int:
        """Read the trainer's :class:`RDMABuffer` ``source`` and load it; returns the bytes read."""
        if self._recv is None or self._recv.numel() != layout.nbytes:
            self._recv = torch.empty(layout.nbytes, dtype=torch.uint8)
        recv = self._recv
        source.read_into(recv, timeout=max(1, int(timeout_s))).get()  # type: ignore[attr-defined]
        unpack_into(self.model, layout, recv, self.who)
        return layout.nbytes

    def map_shared(self, layout: WeightLayout, path: str) -> int:
        """Copy the weights out of the trainer's shared-memory buffer (mapped once, reused)."""
        if self._shared is None or self._shared[0] != path:
            if not os.path.exists(path):
                raise ValueError(
                    f"{self.who}: no shared weight buffer at {path}: is it on the trainer's host?"
                )
            self._shared = (path, torch.from_file(path, shared=True, size=layout.nbytes, dtype=torch.uint8))
        unpack_into(self.model, layout, self._shared[1], self.who)
        return layout.nbytes

    def load(self, layout: WeightLayout, flat: Tensor) -> int:
        """Load a packed buffer sent in a message; returns its bytes."""
        if flat.dtype != torch.uint8 or flat.numel() != layout.nbytes:
            raise ValueError(f"{self.who}: {flat.numel()} packed weight bytes, layout says {layout.nbytes}")
        unpack_into(self.model, layout, flat, self.who)
        return layout.nbytes
