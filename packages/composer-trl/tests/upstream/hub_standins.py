"""Local stand-ins for the Hub ids TRL's own tests load (``trl-internal-testing/...``), which cannot be downloaded
here: each is a directory of the same relative path under one root, and the derived tests run with that root as
their working directory, so ``from_pretrained("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5")`` and
``load_dataset("trl-internal-testing/zen", ...)`` resolve to it (transformers and datasets read an existing local
path before the Hub).

What differs from the Hub originals:
- **models**: the same architectures (class and ``model_type``), tiny random weights built from config (hidden 32,
  2 layers), not the Hub's weights;
- **tokenizer**: NOT the Qwen2.5 tokenizer (151k BPE; not reproducible offline): a byte-level, character
  tokenizer over printable ASCII with Qwen's ChatML chat template (``composer_core.tasks.tiny``), shared by every
  model;
- **tiny-RemoteForCausalLM**: a Qwen2 subclass shipped as custom code (``auto_map``), so loading it needs
  ``trust_remote_code=True`` as the Hub model does;
- **zen**: the Zen of Python (``this``), split into prompt-only rows (``standard_prompt_only``: ``prompt`` text,
  ``conversational_prompt_only``: one user message), 17 train and 2 test rows like the Hub dataset.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import string
import sys
from pathlib import Path
from typing import Any

ORG = "trl-internal-testing"
#: Hub model id -> (transformers class name, model_type)
MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("Qwen2ForCausalLM", "qwen2"),
    "tiny-Qwen2ForSequenceClassification-2.5": ("Qwen2ForSequenceClassification", "qwen2"),
    "tiny-Qwen3ForCausalLM": ("Qwen3ForCausalLM", "qwen3"),
    "tiny-Qwen3ForSequenceClassification": ("Qwen3ForSequenceClassification", "qwen3"),
    "tiny-LlamaForCausalLM-3.2": ("LlamaForCausalLM", "llama"),
    "tiny-LlamaForSequenceClassification-3.2": ("LlamaForSequenceClassification", "llama"),
    "tiny-MistralForCausalLM-0.2": ("MistralForCausalLM", "mistral"),
}
_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
_REMOTE_CONFIG = """from transformers import Qwen2Config


class RemoteConfig(Qwen2Config):
    model_type = "remote"
"""
_REMOTE_MODEL = """from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteConfig
"""


def tokenizer() -> Any:
    from composer_core.tasks.tiny import build_char_tokenizer

    alphabet = "".join(ch for ch in string.printable if ch not in "\t\r\x0b\x0c")
    return build_char_tokenizer(alphabet, chatml=True)


def _model(cls_name: str, model_type: str, tok: Any) -> Any:
    import torch
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        num_labels=1,
        **_SHAPE,
    )
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config)
    if hasattr(
        model, "score"
    ):  # a reward model: scores spread over about ±3, so some reach TRL's threshold 1
        model.score.weight.data.mul_(50.0)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
    return model


def _zen(root: Path) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # prints the Zen of Python on import

    lines = [ln for ln in codecs.decode(this.s, "rot13").splitlines()[2:] if ln.strip()]
    prompts = [" ".join(ln.split()[: max(2, len(ln.split()) // 2)]) for ln in lines][:19]
    splits = {"train": prompts[:17], "test": prompts[17:19]}
    configs = []
    for name, row in (
        ("standard_prompt_only", lambda p: {"prompt": p}),
        ("conversational_prompt_only", lambda p: {"prompt": [{"role": "user", "content": p}]}),
    ):
        files = []
        for split, rows in splits.items():
            path = root / name / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(row(p)) + "\n" for p in rows))
            files.append(f"  - split: {split}\n    path: {name}/{split}.jsonl\n")
        configs.append(f"- config_name: {name}\n  data_files:\n{''.join(files)}")
    (root / "README.md").write_text("---\nconfigs:\n" + "".join(configs) + "---\n")


def build(root: Path) -> Path:
    """Write every stand-in under ``root/trl-internal-testing/`` (idempotent) and return ``root``."""
    org = root / ORG
    if (org / ".complete").exists():
        return root
    tok = tokenizer()
    for name, (cls_name, model_type) in MODELS.items():
        _model(cls_name, model_type, tok).save_pretrained(org / name)
        tok.save_pretrained(org / name)
    remote = org / "tiny-RemoteForCausalLM"
    _model("Qwen2ForCausalLM", "qwen2", tok).save_pretrained(remote)
    tok.save_pretrained(remote)
    (remote / "configuration_remote.py").write_text(_REMOTE_CONFIG)
    (remote / "modeling_remote.py").write_text(_REMOTE_MODEL)
    cfg = json.loads((remote / "config.json").read_text())
    cfg.update(
        model_type="remote",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        },
    )
    (remote / "config.json").write_text(json.dumps(cfg, indent=2))
    _zen(org / "zen")
    (org / ".complete").write_text("")
    return root


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
