"""Optional dependencies: import them lazily and name the extra to install when missing."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` or raise an ImportError that names the pip extra providing it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{feature} needs the optional dependency {module!r}: "
            f"install it with `pip install 'composer-diloco[{extra}]'`."
        ) from exc
