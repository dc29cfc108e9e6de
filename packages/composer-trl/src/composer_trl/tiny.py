"""The tiny Qwen2 and character tokenizer of ``composer-train``, re-exported from composer-core.

The single definition is :mod:`composer_core.tasks.tiny`; this module keeps the ``composer_trl.tiny``
names user code already imports.
"""

from composer_core.tasks.tiny import BOS, EOS, PAD, TinyModelConfig, build_char_tokenizer, build_tiny_model

__all__ = ["BOS", "EOS", "PAD", "TinyModelConfig", "build_char_tokenizer", "build_tiny_model"]
