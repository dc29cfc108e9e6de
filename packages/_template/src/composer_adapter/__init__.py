"""composer_adapter: composer's 3-channel objective in <host>.

Public API: :func:`composer_loss` (replace with the host's hook: a trainer subclass, a registered loss, ...).
"""

from importlib.metadata import version as _version

from composer_adapter.loss import composer_loss

__version__ = _version("composer-adapter")

__all__ = ["__version__", "composer_loss"]
