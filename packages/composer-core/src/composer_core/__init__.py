"""composer_core."""

from importlib.metadata import version as _version

__version__ = _version("composer-core")

__all__ = ["__version__"]
