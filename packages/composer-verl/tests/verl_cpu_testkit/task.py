"""TEST-ONLY: a tiny Qwen2, a character tokenizer with a chat template, a parquet task and its reward.

The task: "write the letter X". Reward = fraction of response characters equal to X, and the reward function
returns the environment's feedback text (``feedback``) that the composer hint function turns into a hint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,:!?>\n"
LETTERS = "abcdefgh"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
)


def build_tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{ch: i + 3 for i, ch in enumerate(ALPHABET)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex("[\\s\\S]"), behavior="isolated"
    )  # every char, newline too
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", padding_side="left"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model_dir(path: Path, *, seed: int = 0) -> Path:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_task(path: Path, n: int = 16, *, pairs: bool = False) -> Path:
    """A parquet in verl's RLHF layout; with ``pairs`` it also carries ``chosen``/``rejected`` columns."""
    import pandas as pd

    rows = []
    for i in range(n):
        letter = LETTERS[i % len(LETTERS)]
        row: dict[str, Any] = {
            "data_source": "composer_letters",
            "prompt": [{"role": "user", "content": f"write {letter}"}],
            "ability": "letters",
            "reward_model": {"style": "rule", "ground_truth": letter},
            "extra_info": {"index": i, "letter": letter},
        }
        if pairs:
            row["chosen"] = letter * 4
            row["rejected"] = "zz"
        rows.append(row)
    pd.DataFrame(rows).to_parquet(path)
    return path


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any
) -> dict:
    """Reward = fraction of characters equal to the target letter; ``feedback`` = what the environment says."""
    text = solution_str.replace("<eos>", "")
    hits = sum(ch == ground_truth for ch in text)
    score = hits / max(len(text), 1)
    feedback = (
        "correct" if score == 1.0 else f"{len(text) - hits} of {len(text)} characters are not {ground_truth}"
    )
    return {"score": float(score), "feedback": feedback}


def hint_from_feedback(prompt: str, response: str, reward: float, extra: dict[str, Any]) -> str | None:
    """The user's hint function: the environment's feedback becomes the hint (None = no hint)."""
    if reward >= 1.0:
        return None
    return (
        f"hint: {extra['feedback']}. write only {extra['reward_model']['ground_truth']}"
        if "reward_model" in extra
        else f"hint: {extra['feedback']}"
    )


def dump(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
