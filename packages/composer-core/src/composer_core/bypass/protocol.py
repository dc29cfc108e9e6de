"""The structural protocol the bypass engine trains through (:class:`BlockwiseModel`; the engine never imports
a model library) and per-block shape configs. Implementations: :mod:`composer_core.bypass.reference` (plain
torch) and :mod:`composer_core.bypass.hf` (Hugging Face Llama / Qwen2 / Mistral).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from torch import Tensor, nn

from composer_core.bypass.distributed import Ownership


@dataclass(frozen=True)
class AttentionConfig:
    """Shape of a block's mixer subblock.

    ``mixer`` is ``"attention"`` (grouped-query attention) or ``"mamba"`` (a state-space
    style mixer; only the reference decoder has one). ``no_op`` removes the subblock: the
    block's residual stream passes it unchanged.
    """

    no_op: bool = False
    num_key_value_heads: int | None = None
    mixer: Literal["attention", "mamba"] = "attention"


@dataclass(frozen=True)
class FFNConfig:
    """Shape of a block's FFN subblock (``no_op`` removes it)."""

    no_op: bool = False
    intermediate_size: int | None = None


@dataclass(frozen=True)
class BlockConfig:
    """Per-block shapes (Puzzle's ``block_configs``)."""

    attention: AttentionConfig = AttentionConfig()
    ffn: FFNConfig = FFNConfig()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> BlockConfig:
        unknown = set(data) - {"attention", "ffn"}
        if unknown:
            raise ValueError(f"block config: unknown keys {sorted(unknown)}; allowed: attention, ffn")
        attn = dict(data.get("attention", {}))
        ffn = dict(data.get("ffn", {}))
        try:
            return BlockConfig(AttentionConfig(**attn), FFNConfig(**ffn))
        except TypeError as exc:
            raise ValueError(f"block config {dict(data)!r}: {exc}") from exc


@dataclass(frozen=True)
class BlockOverride:
    """A change applied to the teacher's block configs to get the student's.

    ``blocks`` lists the block indices it applies to (``None`` = every block). Fields left
    ``None``/``False`` keep the teacher's value. Overrides apply in order; later ones win.
    """

    blocks: tuple[int, ...] | None = None
    intermediate_size: int | None = None
    num_key_value_heads: int | None = None
    attention_no_op: bool = False
    ffn_no_op: bool = False
    mixer: Literal["attention", "mamba"] | None = None

    def apply(self, config: BlockConfig) -> BlockConfig:
        attn, ffn = config.attention, config.ffn
        if self.num_key_value_heads is not None:
            if self.num_key_value_heads < 1:
                raise ValueError(f"num_key_value_heads must be >= 1, got {self.num_key_value_heads}")
            attn = replace(attn, num_key_value_heads=self.num_key_value_heads)
        if self.mixer is not None:
            attn = replace(attn, mixer=self.mixer)
        if self.attention_no_op:
            attn = replace(attn, no_op=True)
        if self.intermediate_size is not None:
            if self.intermediate_size < 1:
                raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")
            ffn = replace(ffn, intermediate_size=self.intermediate_size)
        if self.ffn_no_op:
            ffn = replace(ffn, no_op=True)
        return BlockConfig(attn, ffn)


def resolve_block_configs(
    teacher: Sequence[BlockConfig], overrides: Sequence[BlockOverride], num_blocks: int | None = None
) -> list[BlockConfig]:
    """Apply ``overrides`` to the teacher's per-block configs.

    ``num_blocks`` (if given) is the student's block count and must equal the teacher's:
    the engine pairs student block ``i`` with teacher block ``i``.
    """
    if num_blocks is not None and num_blocks != len(teacher):
        raise ValueError(
            f"student has {num_blocks} blocks but the teacher has {len(teacher)}: bypass distillation "
            "pairs block i of the student with block i of the teacher, so the counts must match "
            "(replace a block by a no-op instead of removing it)"
        )
    configs = list(teacher)
    for override in overrides:
        targets = range(len(configs)) if override.blocks is None else override.blocks
        for i in targets:
            if not 0 <= i < len(configs):
                raise ValueError(f"block override names block {i}, but the teacher has {len(configs)} blocks")
            configs[i] = override.apply(configs[i])
    return configs


@runtime_checkable
class BlockwiseModel(Protocol):
    """What the bypass engine needs from a decoder (teacher or student).

    ``prepare`` embeds tokens and returns the block context (rotary tables, masks ...) that
    every block call needs; ``run_block`` applies block ``index``; ``logits`` applies the
    final norm and LM head. ``with_block_configs(configs, ownership)`` builds a new model whose
    parameters outside ``ownership`` stay on the ``meta`` device; ``save_config`` writes what a
    loader needs besides the weights. ``subblocks`` maps the kinds present in a block
    (``attention``/``ffn``/``mamba``; a no-op subblock is absent) to the modules holding
    that subblock's parameters (its norm and its mixer/FFN).
    """

    @property
    def module(self) -> nn.Module: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def block(self, index: int) -> nn.Module: ...

    def block_prefix(self, index: int) -> str: ...

    def block_configs(self) -> list[BlockConfig]: ...

    def subblocks(self, index: int) -> dict[str, list[nn.Module]]: ...

    def prepare(self, input_ids: Tensor) -> tuple[Tensor, Mapping[str, Any]]: ...

    def run_block(self, index: int, hidden: Tensor, context: Mapping[str, Any]) -> Tensor: ...

    def logits(self, hidden: Tensor) -> Tensor: ...

    def with_block_configs(
        self, configs: Sequence[BlockConfig], ownership: Ownership | None = None
    ) -> BlockwiseModel: ...

    def save(self, directory: str | Path) -> None: ...

    def save_config(self, directory: str | Path) -> None: ...
