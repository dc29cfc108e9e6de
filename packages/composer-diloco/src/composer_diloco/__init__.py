"""composer_diloco."""

from importlib.metadata import version as _version

__version__ = _version("composer-diloco")

__all__ = ["__version__"]
