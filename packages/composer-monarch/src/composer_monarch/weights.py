"""Weights as one packed byte buffer: the trainer → generator/teacher push, never through the driver.

The trainer packs its state dict into one contiguous ``uint8`` buffer (every tensor at an 8-byte aligned
offset, storage shared by tied weights stored once) and describes it with a :class:`WeightLayout`
(name, dtype, shape, offset per tensor: a few KB). The generator and the teacher copy the bytes
straight out of the trainer's buffer and into their own parameters:

* ``"rdma"``: the trainer registers the buffer once as a Monarch :class:`monarch.rdma.RDMABuffer`;
  each receiver ``read_into``-s its own receive buffer (ibverbs where the hardware has it, Monarch's TCP
  transport otherwise, e.g. on CPU-only machines).
* ``"shm"``: receivers on the trainer's host map the trainer's buffer, which lives in shared memory
  (``/dev/shm``), and copy out of it: one copy on each side, no serialisation, no socket. The file is
  unlinked once every receiver has mapped it, so nothing is left behind.
* ``"direct"``: the trainer sends the packed buffer in one actor-to-actor message (one tensor, no
  nested state dict) to each receiver; used where no RDMA backend exists.

Either way the driver only sees the push's receipt (version, bytes, transport). Copies are bitwise
(``Tensor.copy_`` between equal dtypes): after a push every receiver's weights equal the trainer's bit
for bit, in every dtype the model mixes.
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

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slots)


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
    if set(state) != set(layout.names):
        missing, unexpected = sorted(set(state) - set(layout.names)), sorted(set(layout.names) - set(state))
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


def rdma_backend() -> str:
    """Monarch's RDMA backend here: 'ibverbs', 'tcp' or 'none' ('none' also when monarch lacks rdma)."""
    try:
        from monarch.rdma import get_rdma_backend
    except ImportError:  # pragma: no cover - older torchmonarch
        return "none"
    return str(get_rdma_backend())


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
    backend, else 'direct'; checks the name (and that 'shm' is possible)."""
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
    available = rdma_backend() != "none"
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

    def _buffer(self, nbytes: int) -> Tensor:
        if self._recv is None or self._recv.numel() != nbytes:
            self._recv = torch.empty(nbytes, dtype=torch.uint8)
        return self._recv

    def pull(self, layout: WeightLayout, source: object, timeout_s: float) -> int:
        """Read the trainer's :class:`RDMABuffer` ``source`` and load it; returns the bytes read."""
        recv = self._buffer(layout.nbytes)
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
            raise ValueError(
                f"{self.who}: packed weights of {flat.numel()} bytes, layout says {layout.nbytes}"
            )
        unpack_into(self.model, layout, flat, self.who)
        return layout.nbytes


__all__ = [
    "TRANSPORTS",
    "Slot",
    "WeightLayout",
    "WeightReceiver",
    "host_id",
    "layout_of",
    "pack_into",
    "rdma_backend",
    "resolve_transport",
    "shared_buffer",
    "unpack_into",
    "view",
]
