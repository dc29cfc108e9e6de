"""composer_monarch."""

from importlib.metadata import version as _version

__version__ = _version("composer-monarch")

__all__ = ["__version__"]
