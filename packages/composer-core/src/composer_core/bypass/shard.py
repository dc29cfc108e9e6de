"""Sharded model creation: each rank materialises only what it owns (the README's "Several processes").

A model is first built as a *skeleton* inside :func:`meta_parameters` (parameters on the ``meta``
device, buffers real); :func:`materialise` then gives real storage to the parameters a rank owns,
read one tensor at a time from the model's safetensors files (:class:`SafetensorsSource`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from composer_core.bypass.distributed import DistContext, Ownership, partition_blocks
from composer_core.bypass.identity import tensor_fingerprint
from composer_core.bypass.protocol import BlockwiseModel

INDEX_NAME = "model.safetensors.index.json"


@contextmanager
def meta_parameters() -> Iterator[None]:
    """Parameters registered inside this block go to the ``meta`` device; buffers stay real.

    ``torch.empty`` of a parameter before it is registered allocates address space only
    (its pages are never touched), so building a skeleton costs no resident memory.
    """
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def is_embedding(name: str) -> bool:
    """Non-block tensors of the first rank (token embedding); the rest belong to the last rank."""
    return "embed_tokens." in name


def name_owner(model: BlockwiseModel, name: str, world_size: int) -> int | None:
    """The rank owning tensor ``name`` under contiguous partitioning."""
    for r, blocks in enumerate(partition_blocks(model.num_blocks, world_size)):
        if any(name.startswith(model.block_prefix(i)) for i in blocks):
            return r
    return 0 if is_embedding(name) else world_size - 1


def owned_names(model: BlockwiseModel, own: Ownership, *, head: bool) -> list[str]:
    """Parameter and buffer names of ``model`` that rank ``own.rank`` materialises.

    ``head``: also the non-block, non-embedding tensors (final norm, LM head) on the last rank.
    """
    all_blocks = tuple(model.block_prefix(i) for i in range(model.num_blocks))
    mine = tuple(model.block_prefix(i) for i in own.blocks)
    out = []
    for name, _ in model.module.named_parameters(remove_duplicate=False):
        if name.startswith(all_blocks):
            keep = name.startswith(mine)
        elif is_embedding(name):
            keep = own.embed
        else:
            keep = head and own.head
        if keep:
            out.append(name)
    return out


def materialise(module: nn.Module, names: Iterable[str], fill: Callable[[str, Tensor], Tensor]) -> int:
    """Give the meta parameters ``names`` of ``module`` real storage ``fill(name, meta)``; returns bytes.

    A parameter shared by two names (tied embeddings) is filled once and stays shared.
    """
    wanted = set(names)
    made: dict[int, nn.Parameter] = {}
    total = 0
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        if name not in wanted:
            continue
        if id(param) not in made:
            if not param.is_meta:
                continue
            value = fill(name, param)
            if value.shape != param.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
                )
            made[id(param)] = nn.Parameter(value.to(param.dtype), requires_grad=param.requires_grad)
            total += value.numel() * value.element_size()
        owner_path, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner_path), attr, made[id(param)])
    return total


def materialised_bytes(module: nn.Module) -> int:
    """Bytes of the real (non-meta) parameters of ``module`` (each shared tensor once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)


def to_device(module: nn.Module, device: torch.device | str) -> None:
    """Move the real parameters and buffers of ``module`` to ``device`` (meta ones stay meta)."""
    module._apply(lambda t: t if t.is_meta else t.to(device))  # type: ignore[no-untyped-call]


class ModuleSource:
    """The state dict of an in-memory module (a teacher loaded whole)."""

    def __init__(self, module: nn.Module) -> None:
        self._state = module.state_dict()

    def names(self) -> list[str]:
        return list(self._state)

    def get(self, name: str) -> Tensor:
        t: Tensor = self._state[name]
        if t.is_meta:
            raise ValueError(
                f"teacher tensor {name!r} is not materialised on this rank and the teacher has no tensor source; "
                "load the teacher with composer_core.bypass.load_model(path, ownership=...)"
            )
        return t


class SafetensorsSource:
    """Tensors of a model directory's safetensors files, opened lazily with ``safe_open``.

    ``aliases`` maps a name absent from the files to the one holding its value (tied
    ``lm_head.weight`` → ``model.embed_tokens.weight``).
    """

    def __init__(self, directory: str | Path, aliases: Mapping[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.aliases = dict(aliases or {})
        index = self.directory / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise ValueError(f"{index} is not a safetensors index (need a weight_map): {exc}") from exc
            self._map: dict[str, str] = {str(k): str(v) for k, v in weight_map.items()}
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{self.directory} has no *.safetensors weights")
            self._map = {}
            for f in files:
                with safe_open(str(f), framework="pt") as handle:
                    self._map.update({k: f.name for k in handle.keys()})  # noqa: SIM118 (not a dict)
        self.read: list[str] = []

    def names(self) -> list[str]:
        return sorted(self._map)

    def get(self, name: str) -> Tensor:
        key = name if name in self._map else self.aliases.get(name, name)
        if key not in self._map:
            raise ValueError(f"{self.directory}: no tensor {name!r} in its safetensors files")
        self.read.append(key)
        with safe_open(str(self.directory / self._map[key]), framework="pt") as handle:
            tensor: Tensor = handle.get_tensor(key)
        return tensor


TensorSource = ModuleSource | SafetensorsSource


def build_owned(model: BlockwiseModel, ownership: Ownership, build_block: Callable[[int], None]) -> None:
    """Give the owned parts of a skeleton storage: ``build_block(i)`` rebuilds owned block ``i`` under the
    seed ``torch.initial_seed() + 7919·(i + 1)`` (independent of the other blocks); the owned non-block
    parameters become zeros (filled from the teacher)."""
    seed = torch.initial_seed()
    for i in ownership.blocks:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 7919 * (i + 1))
            build_block(i)
    names = owned_names(model, ownership, head=True)
    materialise(model.module, names, lambda _n, p: torch.zeros(p.shape, dtype=p.dtype))


def fill_from_source(
    model: BlockwiseModel,
    source: SafetensorsSource,
    ownership: Ownership | None,
    head: bool,
    device: torch.device | str = "cpu",
) -> None:
    """Read ``ownership``'s tensors of a skeleton from ``source``; without ``ownership`` all of them, and the
    files must hold exactly the model's tensors."""
    own = ownership or Ownership.of(model.num_blocks)
    names = owned_names(model, own, head=head or ownership is None)
    materialise(model.module, names, lambda n, _p: source.get(n).to(device))
    if ownership is None:
        expected = {n for n, _ in model.module.named_parameters(remove_duplicate=False)}
        extra, missing = set(source.names()) - expected, expected - set(source.names()) - set(source.aliases)
        if extra or missing:
            raise ValueError(
                f"{source.directory}: weights do not match the model config "
                f"(missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]})"
            )


def source_of(model: BlockwiseModel) -> TensorSource:
    """Where ``model``'s own tensors come from: its loader's source, else its in-memory state dict."""
    source = getattr(model, "tensor_source", None)
    return source if source is not None else ModuleSource(model.module)


def sharded_fingerprint(model: BlockwiseModel, source: TensorSource, ctx: DistContext) -> str:
    """sha256 of every state-dict tensor of the teacher, each hashed by the rank that owns it.

    Independent of the world size (the same names, the same bytes), and no rank reads a tensor
    it does not own.
    """
    mine: dict[str, str] = {}
    for name, t in sorted(model.module.state_dict().items()):
        if name_owner(model, name, ctx.world_size) != ctx.rank:
            continue
        mine[name] = tensor_fingerprint(source.get(name).to(t.dtype) if t.is_meta else t, tag="")
    merged = {k: v for part in ctx.gather(mine) for k, v in part.items()}
    return hashlib.sha256(json.dumps(merged, sort_keys=True).encode()).hexdigest()
