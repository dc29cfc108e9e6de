"""composer_verl."""

from importlib.metadata import version as _version

__version__ = _version("composer-verl")

__all__ = ["__version__"]
