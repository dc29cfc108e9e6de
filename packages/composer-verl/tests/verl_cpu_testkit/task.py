"""TEST-ONLY: the embedded digit-reversal task as verl data, its reward function and the tiny model directory.

Everything comes from ``composer_core.tasks``: the task's rules (``digit_reversal``: prompt ``"381>"``, answer
``"183"``, partial-credit reward, the verifier's feedback as the hint, oracle ``chosen`` / copied ``rejected``)
and the tiny Qwen2 + character tokenizer (``tiny``). The tokenizer is built in its Qwen2-loadable form
(``chatml=True``): verl loads it from the model directory with ``AutoTokenizer``, which rebuilds a ``qwen2``
tokenizer as transformers' byte-level ``Qwen2Tokenizer``, and verl's agent loop (the Qwen continuous-token
builder) needs ``"\\n"`` as one token and an ``<|im_end|>`` token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer_core.tasks import digit_reversal as T
from composer_core.tasks.tiny import EOS, TinyModelConfig, build_char_tokenizer, build_tiny_model

DATA_SOURCE = "composer_digit_reversal"
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


def write_task(path: Path, n: int = 16, *, pairs: bool = False) -> Path:
    """A parquet in verl's RLHF layout; with ``pairs`` it also carries ``chosen``/``rejected`` columns."""
    import pandas as pd

    rows = []
    for i, r in enumerate(T.make_dataset_rows(n, seed=0)):
        row: dict[str, Any] = {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "ability": "digit_reversal",
            "reward_model": {"style": "rule", "ground_truth": r["chosen"]},
            "extra_info": {"index": i, "task_prompt": r["prompt"]},
        }
        if pairs:
            row["chosen"], row["rejected"] = r["chosen"], r["rejected"]
        rows.append(row)
    pd.DataFrame(rows).to_parquet(path)
    return path


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any
) -> dict[str, Any]:
    """verl's reward-function signature: the task's reward, and its verifier's ``feedback`` (None = correct)."""
    prompt = str((extra_info or {}).get("task_prompt") or T.make_prompt(ground_truth[::-1]))
    completion = solution_str.replace(EOS, "")
    feedback = T.feedback_hint(prompt, completion)
    return {"score": float(T.verify(prompt, completion)), "feedback": feedback or ""}


def hint_from_feedback(prompt: str, response: str, reward: float, extra: dict[str, Any]) -> str | None:
    """The user's hint function: the verifier's feedback becomes the hint (None = no hint)."""
    return extra.get("feedback") or None
