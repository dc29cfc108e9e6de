"""A tiny Qwen2 model and a character tokenizer built locally (no download).

``composer-train`` uses these when no ``--model`` is given; the tests use them too. The tokenizer is a
``tokenizers`` WordLevel model over single characters wrapped in ``PreTrainedTokenizerFast`` (left
padding, as GRPOTrainer requires), so it saves and reloads with ``AutoTokenizer`` like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of ``alphabet`` plus pad/eos/bos."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet) or not alphabet:
        raise ValueError(f"alphabet must be non-empty without repeated characters, got {alphabet!r}")
    vocab = {PAD: 0, EOS: 1, BOS: 2, **{ch: i + 3 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, padding_side="left"
    )


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny Qwen2 (defaults: ≈0.1 M parameters, trains at ~10 steps/s on 2 CPU cores)."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 64


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, config: TinyModelConfig | None = None, *, seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised ``Qwen2ForCausalLM`` sized by ``config`` for ``tokenizer``'s vocabulary."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    c = config or TinyModelConfig()
    qcfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        intermediate_size=c.intermediate_size,
        max_position_embeddings=c.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(qcfg)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return model
