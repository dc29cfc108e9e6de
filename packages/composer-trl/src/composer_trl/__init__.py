"""composer_trl."""

from importlib.metadata import version as _version

__version__ = _version("composer-trl")

__all__ = ["__version__"]
