"""PRIME-RL's own loss module, for side-by-side checks (these tests, ``bench/bench_composer_loss.py``); test
support, not shipped.

prime-rl is not on the package index. :func:`load_upstream` returns ``(prime_rl.trainer.rl.loss,
prime_rl.configs.trainer)`` when ``prime_rl`` is importable (the trainer's environment), else loads
``<PRIME_RL_SRC>/src/prime_rl/trainer/rl/loss.py`` from a checkout. Only the imports that need PRIME-RL's
GPU-stack environment are replaced, and only when missing: the pydantic config classes
(``DefaultLossConfig``, ``CustomLossConfig``, ... as plain dataclasses with upstream's field names and
defaults), ``import_object`` (upstream's rpartition-on-the-last-dot rule) and the ``jaxtyping``/``beartype``
annotations. The loss math is upstream's.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch

__all__ = ["UpstreamUnavailable", "load_upstream"]


class UpstreamUnavailable(LookupError):
    """Neither ``prime_rl`` is importable nor ``PRIME_RL_SRC`` names a checkout."""


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _stub_modules() -> dict[str, types.ModuleType]:
    mods: dict[str, types.ModuleType] = {}

    @dataclasses.dataclass
    class DefaultLossConfig:
        type: str = "default"
        dppo_mask_low: float = 0.2
        dppo_mask_high: float = 0.2
        adv_tau: float = 1.0
        kl_tau: float = 1e-3

    @dataclasses.dataclass
    class IPOLossConfig:
        type: str = "ipo"
        ipo_threshold: float = 0.1
        adv_tau: float = 1.0
        kl_tau: float = 1e-3

    @dataclasses.dataclass
    class CustomLossConfig:
        import_path: str
        kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
        type: str = "custom"

    configs = _module(
        "prime_rl.configs.trainer",
        DefaultLossConfig=DefaultLossConfig,
        IPOLossConfig=IPOLossConfig,
        CustomLossConfig=CustomLossConfig,
        LossConfig=Any,
    )

    def import_object(dotted_path: str) -> Any:
        module_path, _, name = dotted_path.rpartition(".")
        return getattr(importlib.import_module(module_path), name)

    for name in ("prime_rl", "prime_rl.configs", "prime_rl.utils"):
        mods[name] = types.ModuleType(name)
    mods["prime_rl.configs.trainer"] = configs
    mods["prime_rl.utils.utils"] = _module("prime_rl.utils.utils", import_object=import_object)
    if not _importable("jaxtyping"):

        class _Any:
            def __class_getitem__(cls, item: Any) -> Any:
                return torch.Tensor

        mods["jaxtyping"] = _module(
            "jaxtyping", Float=_Any, Bool=_Any, Int=_Any, jaxtyped=lambda typechecker=None: lambda fn: fn
        )
    if not _importable("beartype"):  # each on its own: GPU images often have jaxtyping without beartype
        mods["beartype"] = _module("beartype", beartype=lambda fn: fn)
    return mods


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def load_upstream(src: str | os.PathLike[str] | None = None) -> tuple[types.ModuleType, types.ModuleType]:
    """``(loss module, configs module)`` of PRIME-RL: the installed ``prime_rl``, else the checkout at
    ``src`` (default ``$PRIME_RL_SRC``). Raises :class:`UpstreamUnavailable` (one line) when neither."""
    try:
        from prime_rl.configs import trainer as configs
        from prime_rl.trainer.rl import loss
    except ImportError:
        pass
    else:
        return loss, configs
    src = src or os.environ.get("PRIME_RL_SRC")
    if not src:
        raise UpstreamUnavailable(
            "prime_rl is not importable and PRIME_RL_SRC is unset (prime-rl is not on the package index): "
            "point PRIME_RL_SRC at a prime-rl checkout"
        )
    path = Path(src) / "src/prime_rl/trainer/rl/loss.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"PRIME_RL_SRC={src} has no src/prime_rl/trainer/rl/loss.py; give a prime-rl checkout"
        )
    stubs = _stub_modules()
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("_prime_rl_upstream_loss", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up in sys.modules
        spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module, stubs["prime_rl.configs.trainer"]
