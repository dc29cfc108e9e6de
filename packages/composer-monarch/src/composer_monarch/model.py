"""A tiny Qwen2 causal LM built from its config (no download), and the forward helpers the actors share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class TinyQwen2:
    """Picklable factory of composer-core's tiny ``Qwen2ForCausalLM`` (:func:`composer_core.tasks.tiny.build_tiny_qwen2`,
    eager attention; hidden 64, 2 layers by default). Every actor builds its own copy; ``seed`` fixes the initial
    weights. Needs ``transformers`` (``pip install 'composer-monarch[hf]'``).
    """

    vocab_size: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_positions: int = 128
    seed: int = 0

    def __call__(self) -> nn.Module:
        from composer_core.tasks.tiny import TinyModelConfig, build_tiny_qwen2

        config = TinyModelConfig(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_positions,
            attn_implementation="eager",
        )
        model: nn.Module = build_tiny_qwen2(self.vocab_size, config, seed=self.seed)
        return model


def forward_logits(model: nn.Module, tokens: Tensor) -> Tensor:
    """Logits [B, L, V] of a causal LM (a Hugging Face model or any module returning logits)."""
    hf = hasattr(model, "config") and hasattr(model, "get_input_embeddings")
    out = model(input_ids=tokens, use_cache=False) if hf else model(tokens)
    logits = getattr(out, "logits", out)
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(
            f"model returned {type(logits).__name__} of shape {getattr(logits, 'shape', None)}: "
            "expected logits [batch, length, vocab]"
        )
    return logits


def completion_logits(model: nn.Module, prompt_ids: Tensor, completion_ids: Tensor) -> Tensor:
    """Logits [B, T, V] at the positions that predict each completion token (position P-1+t predicts token t)."""
    p, t = prompt_ids.shape[1], completion_ids.shape[1]
    return forward_logits(model, torch.cat([prompt_ids, completion_ids], dim=1))[:, p - 1 : p + t - 1]


def upcast(x: Tensor) -> Tensor:
    """Half precision → float32; float32 and float64 unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def token_logprobs(logits: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) gathered at ``ids``: [B, T, V], [B, T] → [B, T] (float32+).

    TorchForge's order (``forge.util.ops.compute_logprobs``): divide in the logits' dtype, then upcast.
    """
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(upcast(logits), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
