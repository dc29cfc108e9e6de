"""Per-process setup run by ``spawn_procs(bootstrap=...)`` before any actor is built.

Actors that share a process are constructed on different threads, and concurrent first imports of
one package race (a ``KeyError`` from importlib, or a half-initialised ``transformers``). Importing
everything here, once, on one thread, makes the later unpickling of actor classes a lookup.
"""

from __future__ import annotations

import importlib
import importlib.util


def prepare_process() -> None:
    """Import composer_monarch (all actor modules) and, if installed, the Qwen2 model code."""
    importlib.import_module("composer_monarch")
    if importlib.util.find_spec("transformers") is not None:
        importlib.import_module("transformers.models.qwen2")
