"""A plain-torch reference decoder (Llama layout) implementing :class:`BlockwiseModel`.

Pre-norm blocks ``h = h + attn(norm1(h)); h = h + ffn(norm2(h))`` with grouped-query
attention and rotary embeddings (Su et al. 2021), a SwiGLU FFN (Shazeer 2020) and RMSNorm.
Module names follow Hugging Face Llama (``layers.i.self_attn.k_proj`` ...), so student
initialisation treats both the same way. Per-block shapes come from ``block_configs``.

The ``"mamba"`` mixer is a stand-in, not Mamba (a gated causal depthwise convolution), so the
engine's ``subblock_mamba`` path has a real model to run on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from composer_core.bypass.checkpoint import read_json
from composer_core.bypass.distributed import Ownership
from composer_core.bypass.protocol import BlockConfig, BlockwiseModel
from composer_core.bypass.shard import SafetensorsSource, build_owned, fill_from_source, meta_parameters

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class ReferenceConfig:
    """Global shapes; ``block_configs`` (one per layer, or empty = uniform) override per block."""

    vocab_size: int = 128
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    block_configs: tuple[BlockConfig, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        if self.block_configs and len(self.block_configs) != self.num_layers:
            raise ValueError(
                f"block_configs has {len(self.block_configs)} entries, expected num_layers={self.num_layers}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def resolved(self) -> list[BlockConfig]:
        """Per-block configs with every ``None`` filled from the global shapes."""
        base = list(self.block_configs) or [BlockConfig()] * self.num_layers
        out = []
        for cfg in base:
            kv = cfg.attention.num_key_value_heads or self.num_kv_heads
            if self.num_heads % kv:
                raise ValueError(f"num_key_value_heads={kv} must divide num_heads={self.num_heads}")
            out.append(
                BlockConfig(
                    replace(cfg.attention, num_key_value_heads=kv),
                    replace(cfg.ffn, intermediate_size=cfg.ffn.intermediate_size or self.intermediate_size),
                )
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> ReferenceConfig:
        data = dict(data)
        blocks = tuple(BlockConfig.from_dict(b) for b in data.pop("block_configs", []))
        unknown = set(data) - set(ReferenceConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"reference config: unknown keys {sorted(unknown)}")
        return ReferenceConfig(**data, block_configs=blocks)


def _rope(x: Tensor, rot: Tensor) -> Tensor:
    """Rotate consecutive channel pairs of ``x [B, heads, T, d]`` by the unit complex ``rot [T, d/2]``."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: Tensor, rot: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = _rope(self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2), rot)
        k = _rope(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2), rot)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)  # grouped KV heads, expanded
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))  # type: ignore[no-any-return]


class ConvMixer(nn.Module):
    """Stand-in state-space mixer: gated causal depthwise convolution (not real Mamba)."""

    def __init__(self, hidden: int, kernel: int = 4) -> None:
        super().__init__()
        self.in_proj = nn.Linear(hidden, 2 * hidden, bias=False)
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, padding=kernel - 1)
        self.out_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: Tensor, rot: Tensor) -> Tensor:
        v, gate = self.in_proj(x).chunk(2, dim=-1)
        t = x.shape[1]
        v = self.conv(v.transpose(1, 2))[..., :t].transpose(1, 2)
        return self.out_proj(F.silu(gate) * v)  # type: ignore[no-any-return]


class MLP(nn.Module):
    """SwiGLU FFN: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class Block(nn.Module):
    """One pre-norm decoder block; a no-op subblock has neither module nor norm."""

    def __init__(self, cfg: ReferenceConfig, block: BlockConfig) -> None:
        super().__init__()
        self.input_layernorm: nn.RMSNorm | None = None
        self.self_attn: Attention | None = None
        self.mamba: ConvMixer | None = None
        self.post_attention_layernorm: nn.RMSNorm | None = None
        self.mlp: MLP | None = None
        if not block.attention.no_op:
            self.input_layernorm = nn.RMSNorm(cfg.hidden_size, cfg.norm_eps)
            if block.attention.mixer == "mamba":
                self.mamba = ConvMixer(cfg.hidden_size)
            else:
                kv = block.attention.num_key_value_heads or cfg.num_kv_heads
                self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, kv, cfg.head_dim)
        if not block.ffn.no_op:
            self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.mlp = MLP(cfg.hidden_size, block.ffn.intermediate_size or cfg.intermediate_size)

    def forward(self, h: Tensor, rot: Tensor) -> Tensor:
        mixer = self.self_attn if self.self_attn is not None else self.mamba
        if mixer is not None and self.input_layernorm is not None:
            h = h + mixer(self.input_layernorm(h), rot)
        if self.mlp is not None and self.post_attention_layernorm is not None:
            h = h + self.mlp(self.post_attention_layernorm(h))
        return h


def _embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)`` with the same N(0, 1) draws, but none on a ``meta`` skeleton: ``normal_``
    has no C++ meta kernel and its Python one imports torch._dynamo (seconds per process)."""
    emb = nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    if not emb.weight.is_meta:
        nn.init.normal_(emb.weight)  # what nn.Embedding.reset_parameters draws
    return emb


class ReferenceDecoder(nn.Module):
    """Plain-torch decoder LM implementing :class:`~composer_core.bypass.protocol.BlockwiseModel`."""

    tensor_source: SafetensorsSource | None = None

    def __init__(self, config: ReferenceConfig, ownership: Ownership | None = None) -> None:
        """Build the decoder; with ``ownership`` only its parts get storage (see :func:`shard.build_owned`)."""
        super().__init__()
        self.config = config
        self._blocks = config.resolved()
        with meta_parameters() if ownership is not None else nullcontext():
            self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(Block(config, b) for b in self._blocks)
            self.norm = nn.RMSNorm(config.hidden_size, config.norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        inv = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)
        if ownership is not None:
            build_owned(self, ownership, lambda i: self.layers.__setitem__(i, Block(config, self._blocks[i])))

    @property
    def module(self) -> nn.Module:
        return self

    @property
    def num_blocks(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def block(self, index: int) -> nn.Module:
        return self.layers[index]

    def block_prefix(self, index: int) -> str:
        return f"layers.{index}."

    def block_configs(self) -> list[BlockConfig]:
        return list(self._blocks)

    def subblocks(self, index: int) -> dict[str, list[nn.Module]]:
        layer = cast(Block, self.layers[index])
        out: dict[str, list[nn.Module]] = {}
        for kind, mixer in (("attention", layer.self_attn), ("mamba", layer.mamba)):
            if mixer is not None and layer.input_layernorm is not None:
                out[kind] = [layer.input_layernorm, mixer]
        if layer.mlp is not None and layer.post_attention_layernorm is not None:
            out["ffn"] = [layer.post_attention_layernorm, layer.mlp]
        return out

    def prepare(self, input_ids: Tensor) -> tuple[Tensor, Mapping[str, Any]]:
        weight = self.embed_tokens.weight
        if weight.is_meta:  # not the first rank: the hidden state comes from the previous rank
            hidden = torch.zeros(
                *input_ids.shape, weight.shape[1], dtype=weight.dtype, device=input_ids.device
            )
        else:
            hidden = self.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[-1], device=hidden.device, dtype=torch.float32)
        freqs = torch.outer(pos, cast(Tensor, self.inv_freq).to(hidden.device))
        return hidden, {"rot": torch.polar(torch.ones_like(freqs), freqs)}

    def run_block(self, index: int, hidden: Tensor, context: Mapping[str, Any]) -> Tensor:
        return self.layers[index](hidden, context["rot"])  # type: ignore[no-any-return]

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))  # type: ignore[no-any-return]

    def with_block_configs(
        self, configs: Sequence[BlockConfig], ownership: Ownership | None = None
    ) -> BlockwiseModel:
        return ReferenceDecoder(replace(self.config, block_configs=tuple(configs)), ownership)

    def save_config(self, directory: str | Path) -> None:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2))

    def save(self, directory: str | Path) -> None:
        self.save_config(directory)
        save_file(
            {k: v.contiguous() for k, v in self.state_dict().items()}, str(Path(directory) / WEIGHTS_NAME)
        )

    def forward(self, input_ids: Tensor) -> Tensor:
        hidden, ctx = self.prepare(input_ids)
        for i in range(self.num_blocks):
            hidden = self.run_block(i, hidden, ctx)
        return self.logits(hidden)

    @staticmethod
    def load(
        directory: str | Path, ownership: Ownership | None = None, *, head: bool = True
    ) -> ReferenceDecoder:
        """Load a decoder written by :meth:`save` or a sharded export (config.json + safetensors).

        With ``ownership`` only the owned tensors are read (the rest stay on ``meta``); ``head=False``
        skips the final norm and LM head (a teacher never needs them).
        """
        path = Path(directory)
        fix = f"not a reference decoder directory: need {CONFIG_NAME} and safetensors"
        config = ReferenceConfig.from_dict(read_json(path / CONFIG_NAME, fix))
        source = SafetensorsSource(path)
        with meta_parameters():
            model = ReferenceDecoder(config)
        fill_from_source(model, source, ownership, head)
        model.tensor_source = source
        return model
