"""Embedded tasks and tiny models that the adapters' main jobs and tests share.

- :mod:`composer_core.tasks.digit_reversal`: the digit-reversal task (prompts, the reward rule, the hint
  rule, the oracle answer, the character ids), pure Python;
- :mod:`composer_core.tasks.tiny`: a tiny Qwen2 and a character tokenizer built locally (``hf`` extra).

Import the submodules directly; this package imports nothing heavy.
"""
