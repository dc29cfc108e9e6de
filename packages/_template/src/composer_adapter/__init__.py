"""composer_adapter: composer's 3-channel objective in <host>.

Public API: :func:`compose_config` (the host's options → composer-core's typed config, once) and
:func:`composer_loss` (the host's tensors → the loss; replace with the host's hook: a trainer subclass, a
registered loss, ...).
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from composer_adapter.config import compose_config
from composer_adapter.loss import composer_loss, to_batch

try:
    __version__ = _version("composer-adapter")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+source"

__all__ = ["__version__", "compose_config", "composer_loss", "to_batch"]
