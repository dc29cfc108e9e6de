"""Hugging Face Llama / Qwen2 / Mistral-style causal LMs as :class:`BlockwiseModel` (extra ``hf``).

Supported: ``*ForCausalLM`` models with ``model.{embed_tokens, layers, norm}`` and ``lm_head``, each
layer with ``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``. How the block context
is recorded, how students are rebuilt and why a heterogeneous student needs :func:`load_hf_model`
(``config.composer_block_configs``): the README's **Models**.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from composer_core.bypass.distributed import Ownership
from composer_core.bypass.protocol import AttentionConfig, BlockConfig, BlockwiseModel, FFNConfig
from composer_core.bypass.shard import SafetensorsSource, build_owned, fill_from_source, meta_parameters

BLOCK_CONFIGS_KEY = "composer_block_configs"


class NoOpAttention(nn.Module):
    """Replaces a removed attention subblock: contributes zero to the residual stream."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        return torch.zeros_like(hidden_states), None


class NoOpMLP(nn.Module):
    """Replaces a removed FFN subblock: contributes zero to the residual stream."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        return torch.zeros_like(hidden_states)


class _Recorder(nn.Module):
    def __init__(self, index: int, sink: dict[int, tuple[Tensor, dict[str, Any]]], like: nn.Module) -> None:
        super().__init__()
        self.index, self.sink = index, sink
        if hasattr(like, "attention_type"):
            self.attention_type = like.attention_type

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args:
            raise TypeError("decoder layers called with positional context arguments are not supported")
        self.sink[self.index] = (hidden_states, kwargs)
        return hidden_states


class HFDecoder:
    """Wrap a transformers causal LM (Llama layout) as a :class:`BlockwiseModel`."""

    def __init__(self, model: nn.Module) -> None:
        base: Any = getattr(model, "model", None)
        layer_attrs = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
        ok = hasattr(model, "lm_head") and all(hasattr(base, n) for n in ("embed_tokens", "layers", "norm"))
        if not ok or not all(hasattr(x, a) for x in base.layers for a in layer_attrs):
            raise ValueError(
                f"{type(model).__name__} is not a Llama-style causal LM (need .model.embed_tokens, .model.layers "
                f"with {', '.join(layer_attrs)}, .model.norm and .lm_head); supported: Llama, Qwen2, Mistral"
            )
        self.model: Any = model
        self.base: Any = base
        self.tensor_source: SafetensorsSource | None = None

    @property
    def module(self) -> nn.Module:
        return cast(nn.Module, self.model)

    @property
    def num_blocks(self) -> int:
        return len(self.base.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.base.embed_tokens.num_embeddings)

    def block(self, index: int) -> nn.Module:
        return self.base.layers[index]  # type: ignore[no-any-return]

    def block_prefix(self, index: int) -> str:
        return f"model.layers.{index}."

    def block_configs(self) -> list[BlockConfig]:
        cfg = self.model.config
        stored = getattr(cfg, BLOCK_CONFIGS_KEY, None)
        if stored:
            if len(stored) != self.num_blocks:
                raise ValueError(
                    f"config.{BLOCK_CONFIGS_KEY} has {len(stored)} entries for {self.num_blocks} layers"
                )
            return [BlockConfig.from_dict(b) for b in stored]
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return [
            BlockConfig(
                AttentionConfig(num_key_value_heads=kv), FFNConfig(intermediate_size=cfg.intermediate_size)
            )
            for _ in range(self.num_blocks)
        ]

    def subblocks(self, index: int) -> dict[str, list[nn.Module]]:
        layer = self.base.layers[index]
        out: dict[str, list[nn.Module]] = {}
        if not isinstance(layer.self_attn, NoOpAttention):
            out["attention"] = [layer.input_layernorm, layer.self_attn]
        if not isinstance(layer.mlp, NoOpMLP):
            out["ffn"] = [layer.post_attention_layernorm, layer.mlp]
        return out

    def prepare(self, input_ids: Tensor) -> tuple[Tensor, Mapping[str, Any]]:
        """Embed (first rank; elsewhere zeros of the right shape) and record every layer's context."""
        sink: dict[int, tuple[Tensor, dict[str, Any]]] = {}
        layers, norm = self.base.layers, self.base.norm
        self.base.layers = nn.ModuleList(_Recorder(i, sink, layer) for i, layer in enumerate(layers))
        self.base.norm = nn.Identity()  # the final norm may be absent (meta) on this rank
        weight = self.base.embed_tokens.weight
        try:
            if weight.is_meta:
                embeds = torch.zeros(
                    *input_ids.shape, weight.shape[1], dtype=weight.dtype, device=input_ids.device
                )
                self.base(inputs_embeds=embeds, use_cache=False)
            else:
                self.base(input_ids=input_ids, use_cache=False)
        finally:
            self.base.layers, self.base.norm = layers, norm
        if len(sink) != len(layers):
            raise RuntimeError(
                f"{type(self.model).__name__}.forward called {len(sink)} of {len(layers)} layers"
            )
        return sink[0][0], {"per_layer": [sink[i][1] for i in range(len(layers))]}

    def run_block(self, index: int, hidden: Tensor, context: Mapping[str, Any]) -> Tensor:
        out = self.base.layers[index](hidden, **context["per_layer"][index])
        return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(self.base.norm(hidden))  # type: ignore[no-any-return]

    def with_block_configs(
        self, configs: Sequence[BlockConfig], ownership: Ownership | None = None
    ) -> BlockwiseModel:
        """A new model with these block shapes; with ``ownership`` only the owned parts get storage."""
        if len(configs) != self.num_blocks:
            raise ValueError(f"got {len(configs)} block configs for a model with {self.num_blocks} layers")
        cfg = copy.deepcopy(self.model.config)
        if hasattr(cfg, BLOCK_CONFIGS_KEY):
            delattr(cfg, BLOCK_CONFIGS_KEY)
        dtype = next(self.model.parameters()).dtype
        with meta_parameters() if ownership else nullcontext():
            model = HFDecoder(type(self.model)(cfg).to(dtype))
            apply_block_configs(model.model, configs)
        if ownership is None:
            return model

        def build(i: int) -> None:
            model.base.layers[i] = type(model.base.layers[i])(cfg, layer_idx=i).to(dtype)
            _configure_layer(model.base.layers[i], cfg, configs[i], i)

        build_owned(model, ownership, build)
        return model

    def save_config(self, directory: str | Path) -> None:
        """The config with the per-block shapes (see module doc), no weights."""
        configs = self.block_configs()
        cfg = self.model.config
        setattr(cfg, BLOCK_CONFIGS_KEY, [c.to_dict() for c in configs])
        if all(c == configs[0] for c in configs) and not (configs[0].attention.no_op or configs[0].ffn.no_op):
            cfg.intermediate_size = configs[0].ffn.intermediate_size
            cfg.num_key_value_heads = configs[0].attention.num_key_value_heads
        cfg.save_pretrained(str(directory))

    def save(self, directory: str | Path) -> None:
        """``save_pretrained`` with the per-block shapes recorded in the config (see module doc)."""
        self.save_config(directory)
        self.model.save_pretrained(str(directory))


def apply_block_configs(model: nn.Module, configs: Sequence[BlockConfig]) -> None:
    """Rebuild the layers of a freshly created HF model to the given per-block shapes."""
    cfg: Any = model.config
    base: Any = model.model
    for i, (layer, bc) in enumerate(zip(base.layers, configs, strict=True)):
        _configure_layer(layer, cfg, bc, i)
    setattr(cfg, BLOCK_CONFIGS_KEY, [c.to_dict() for c in configs])


def _configure_layer(layer: Any, cfg: Any, bc: BlockConfig, i: int) -> None:
    """Rebuild one decoder layer's attention / MLP to the shapes of ``bc`` (no-op modules included)."""
    if bc.attention.mixer != "attention":
        raise ValueError(
            f"block {i}: mixer={bc.attention.mixer!r} is not supported for HF models (attention only)"
        )
    dtype = layer.input_layernorm.weight.dtype
    if bc.attention.no_op:
        layer.self_attn = NoOpAttention()
        layer.input_layernorm = nn.Identity()
    elif bc.attention.num_key_value_heads not in (None, cfg.num_key_value_heads):
        local = copy.deepcopy(cfg)
        local.num_key_value_heads = bc.attention.num_key_value_heads
        if cfg.num_attention_heads % local.num_key_value_heads:
            raise ValueError(
                f"block {i}: num_key_value_heads={local.num_key_value_heads} must divide "
                f"num_attention_heads={cfg.num_attention_heads}"
            )
        layer.self_attn = type(layer.self_attn)(local, layer_idx=i).to(dtype)
    if bc.ffn.no_op:
        layer.mlp = NoOpMLP()
        layer.post_attention_layernorm = nn.Identity()
    elif bc.ffn.intermediate_size not in (None, cfg.intermediate_size):
        local = copy.deepcopy(cfg)
        local.intermediate_size = bc.ffn.intermediate_size
        layer.mlp = type(layer.mlp)(local).to(dtype)


def load_hf_model(
    path: str | Path,
    *,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    ownership: Ownership | None = None,
    head: bool = True,
    device: torch.device | str = "cpu",
) -> HFDecoder:
    """Load a teacher or a saved student (honouring ``composer_block_configs``) as an :class:`HFDecoder`.

    Only the tensors ``ownership`` names (default: all) are read, one at a time, onto ``device``;
    ``head=False`` leaves the final norm and LM head unread (a teacher never needs them).
    """
    try:
        tf: Any = importlib.import_module("transformers")
    except ImportError as exc:
        raise ImportError(
            "Hugging Face models in the bypass engine need transformers: pip install 'composer-core[hf]'"
        ) from exc
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"{p} is not a Hugging Face model directory (no config.json); local paths only here")
    config = tf.AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    stored = getattr(config, BLOCK_CONFIGS_KEY, None)
    with meta_parameters():
        model = tf.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code).to(dtype)
        if stored:
            apply_block_configs(model, [BlockConfig.from_dict(b) for b in stored])
    tied = bool(getattr(config, "tie_word_embeddings", False))
    source = SafetensorsSource(p, aliases={"lm_head.weight": "model.embed_tokens.weight"} if tied else None)
    decoder = HFDecoder(model)
    fill_from_source(decoder, source, ownership, head, device)
    decoder.tensor_source = source
    model.eval()
    return decoder
