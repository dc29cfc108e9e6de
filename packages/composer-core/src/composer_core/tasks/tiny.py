"""A tiny Qwen2 causal LM and a character tokenizer, built locally (no download).

composer-trl's main job (``composer-train`` without ``--model``), composer-monarch's ``TinyQwen2`` and their
tests build their model here. The builders need the ``hf`` extra (``pip install 'composer-core[hf]'``);
importing this module needs only the standard library.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "BOS",
    "BOS_ID",
    "CHATML_TEMPLATE",
    "EOS",
    "EOS_ID",
    "IM_END",
    "IM_START",
    "PAD",
    "PAD_ID",
    "TinyModelConfig",
    "build_char_tokenizer",
    "build_tiny_model",
    "build_tiny_qwen2",
    "char_vocab",
]

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen's ChatML layout (no default system message): what ``chatml=True`` tokenizers render."""
_CHATML_CHARS = "\naeimnrstuy"  # the characters of the template's own text (roles, newlines)

_HF_EXTRA = "pip install 'composer-core[hf]'"

# transformers' lazy module is not safe to initialise from two threads at once, and seeded
# initialisation forks torch's global RNG: both happen under this lock.
_BUILD_LOCK = threading.Lock()


def char_vocab(alphabet: str) -> dict[str, int]:
    """``{"<pad>": 0, "<eos>": 1, "<bos>": 2, alphabet[0]: 3, ...}``: one id per character."""
    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet must be non-empty without repeated characters, got {alphabet!r}")
    return {PAD: PAD_ID, EOS: EOS_ID, BOS: BOS_ID, **{ch: i + 3 for i, ch in enumerate(alphabet)}}


def build_char_tokenizer(alphabet: str, *, chatml: bool = False) -> PreTrainedTokenizerFast:
    """A character-level ``PreTrainedTokenizerFast`` with the ids of :func:`char_vocab` (left padding, as TRL's
    GRPOTrainer requires).

    ``chatml=True``: the byte-level, ChatML form a Qwen2 model directory needs (for hosts that reload the
    tokenizer by the model's type). ``alphabet`` must be ASCII; the
    characters the ChatML template needs that ``alphabet`` lacks (role names, ``"\\n"``) get the next ids,
    then ``<|im_start|>`` and ``<|im_end|>``: the ids of ``alphabet`` itself are those of :func:`char_vocab`.
    """
    vocab = char_vocab(alphabet)
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte -> symbol table
    except ImportError as e:
        raise ImportError(f"build_char_tokenizer needs tokenizers and transformers: {_HF_EXTRA}") from e

    if not chatml:
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        # transformers 5's tokenizer __init__ and GenerationConfig are untyped (4.x may type them)
        return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call, unused-ignore]
            tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, padding_side="left"
        )
    vocab = _byte_level_vocab(alphabet, bytes_to_unicode())  # type: ignore[no-untyped-call, unused-ignore]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in (PAD, EOS, BOS, IM_START, IM_END)])
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call, unused-ignore]
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=PAD,  # else Qwen2Tokenizer (the reload of a qwen2 model dir) adds <|endoftext|> as a new id
        additional_special_tokens=[IM_START, IM_END],
        padding_side="left",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _byte_level_vocab(alphabet: str, symbol: dict[int, str]) -> dict[str, int]:
    """:func:`char_vocab` + the template's characters + ChatML specials, keyed by byte-level symbols."""
    if not alphabet.isascii():
        raise ValueError(f"build_char_tokenizer(chatml=True) needs an ASCII alphabet, got {alphabet!r}")
    chars = alphabet + "".join(ch for ch in _CHATML_CHARS if ch not in alphabet)
    vocab = {PAD: PAD_ID, EOS: EOS_ID, BOS: BOS_ID}
    vocab.update({symbol[ord(ch)]: i + 3 for i, ch in enumerate(chars)})
    vocab.update({IM_START: len(vocab), IM_END: len(vocab) + 1})
    return vocab


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny Qwen2 (defaults: ≈0.1 M parameters, trains at ~10 steps/s on 2 CPU cores).

    ``attn_implementation``: None keeps transformers' default (sdpa); composer-monarch passes "eager".
    ``num_experts`` > 0 builds a mixture-of-experts ``Qwen2MoeForCausalLM`` instead (every layer sparse,
    ``num_experts_per_tok`` experts of width ``moe_intermediate_size`` per token plus a shared expert of
    width ``shared_expert_intermediate_size``; the router load-balancing loss at transformers' default
    coefficient); 0 (the default) keeps the dense ``Qwen2ForCausalLM``.
    """

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 64
    attn_implementation: str | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 32

    def __post_init__(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"num_experts={self.num_experts}: must be >= 0 (0 builds the dense Qwen2)")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok}: must be in [1, num_experts={self.num_experts}]"
            )


def build_tiny_qwen2(
    vocab_size: int,
    config: TinyModelConfig | None = None,
    *,
    seed: int = 0,
    pad_id: int = PAD_ID,
    eos_id: int = EOS_ID,
    bos_id: int = BOS_ID,
) -> PreTrainedModel:
    """A randomly initialised ``Qwen2ForCausalLM`` (``Qwen2MoeForCausalLM`` when ``config.num_experts`` > 0)
    with ``vocab_size`` tokens, weights fixed by ``seed``.

    The caller's global torch RNG state is left as it was (the seeded draw runs in a forked RNG).
    """
    import torch

    try:
        with _BUILD_LOCK:
            from transformers import GenerationConfig
    except ImportError as e:
        raise ImportError(f"build_tiny_qwen2 needs transformers: {_HF_EXTRA}") from e

    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 1")
    c = config or TinyModelConfig()
    model_cls, hf_config = _hf_config(c, vocab_size, pad_id=pad_id, eos_id=eos_id, bos_id=bos_id)
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = model_cls(hf_config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call, unused-ignore]
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=bos_id
    )
    return model


def _hf_config(
    c: TinyModelConfig, vocab_size: int, *, pad_id: int, eos_id: int, bos_id: int
) -> tuple[Any, Any]:
    """(model class, transformers config) for ``c``: dense Qwen2, or Qwen2-MoE when ``c.num_experts`` > 0."""
    with _BUILD_LOCK:
        from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    shape = asdict(c)
    attn = shape.pop("attn_implementation")
    moe_fields = "num_experts num_experts_per_tok moe_intermediate_size shared_expert_intermediate_size"
    moe = {k: shape.pop(k) for k in moe_fields.split()}
    common: dict[str, Any] = {**shape, "vocab_size": vocab_size, "tie_word_embeddings": False}
    common |= {"pad_token_id": pad_id, "eos_token_id": eos_id, "bos_token_id": bos_id}
    if attn is not None:
        common["attn_implementation"] = attn
    if not c.num_experts:
        return Qwen2ForCausalLM, Qwen2Config(**common)
    return Qwen2MoeForCausalLM, Qwen2MoeConfig(decoder_sparse_step=1, **moe, **common)


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, config: TinyModelConfig | None = None, *, seed: int = 0
) -> PreTrainedModel:
    """:func:`build_tiny_qwen2` sized for ``tokenizer``'s vocabulary and special tokens."""
    ids = {f"{which}_id": _token_id(tokenizer, which) for which in ("pad", "eos", "bos")}
    return build_tiny_qwen2(len(tokenizer), config, seed=seed, **ids)


def _token_id(tokenizer: PreTrainedTokenizerFast, which: str) -> int:
    value = getattr(tokenizer, f"{which}_token_id")
    if not isinstance(value, int):
        raise ValueError(f"the tokenizer has no {which} token: build it with build_char_tokenizer(alphabet)")
    return value
