"""Replica process entry point: ``python -m composer_diloco._worker SPEC.json``, SPEC =
``{"target": "package.module:function", "kwargs": {...}, "result": "/path"}``; the return value is written
with ``torch.save`` (read back with ``weights_only=True``).
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from typing import Any


def resolve(target: str) -> Callable[..., Any]:
    """Import ``"package.module:function"``."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}.")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise ValueError(f"target {target!r} is not callable.")
    return fn  # type: ignore[no-any-return]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m composer_diloco._worker SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    value = resolve(spec["target"])(**spec.get("kwargs", {}))
    if spec.get("result"):
        import torch

        torch.save(value, spec["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
