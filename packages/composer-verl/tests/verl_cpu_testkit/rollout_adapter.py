"""TEST-ONLY: the worker-side adapter class, importable by verl's dotted path."""

from verl_cpu_testkit.rollout import _adapter_cls

HFGenerateAdapter = _adapter_cls()
