"""TEST-ONLY: the tiny model directory for the embedded digit-reversal task, and a user-written hint function.

The task itself (data, reward, feedback) comes from the environment ``digit-reversal``
(``composer_core.envs``) through ``composer_verl.envs``; the tiny Qwen2 + character tokenizer come from
``composer_core.tasks.tiny``. The tokenizer is built in its Qwen2-loadable form
(``chatml=True``): verl loads it from the model directory with ``AutoTokenizer``, which rebuilds a ``qwen2``
tokenizer as transformers' byte-level ``Qwen2Tokenizer``, and verl's agent loop (the Qwen continuous-token
builder) needs ``"\\n"`` as one token and an ``<|im_end|>`` token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer_core.tasks import digit_reversal as T
from composer_core.tasks.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

MODEL = TinyModelConfig(hidden_size=32, intermediate_size=64, max_position_embeddings=128)


def build_tokenizer() -> Any:
    return build_char_tokenizer(T.ALPHABET, chatml=True)


def build_model_dir(path: Path, *, seed: int = 0) -> Path:
    tok = build_tokenizer()
    model = build_tiny_model(tok, MODEL, seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def hint_from_feedback(prompt: str, response: str, reward: float, extra: dict[str, Any]) -> str | None:
    """The user's hint function: the verifier's feedback becomes the hint (None = no hint)."""
    return extra.get("feedback") or None
