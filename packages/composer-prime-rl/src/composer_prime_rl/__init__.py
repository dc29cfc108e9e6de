"""composer_prime_rl."""

from importlib.metadata import version as _version

__version__ = _version("composer-prime-rl")

__all__ = ["__version__"]
