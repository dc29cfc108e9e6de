"""composer_trl: composer's 3-channel objective inside TRL's GRPOTrainer.

Swap ``GRPOConfig``/``GRPOTrainer`` for :class:`ComposerGRPOConfig`/:class:`ComposerGRPOTrainer`, and TRL's
``trl.experimental.sdpo`` ``SDPOConfig``/``SDPOTrainer`` for :class:`ComposerSDPOConfig`/:class:`ComposerSDPOTrainer`.
``composer-train`` (:mod:`composer_trl.cli`) is the one-command demo and training entry point.
"""

from importlib import import_module
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

__version__ = _version("composer-trl")

__all__ = [
    "ComposerGRPOConfig",
    "ComposerGRPOTrainer",
    "ComposerSDPOConfig",
    "ComposerSDPOTrainer",
    "__version__",
]

if TYPE_CHECKING:
    from composer_trl.config import ComposerGRPOConfig
    from composer_trl.sdpo import ComposerSDPOConfig, ComposerSDPOTrainer
    from composer_trl.trainer import ComposerGRPOTrainer


def __getattr__(name: str) -> Any:
    # Lazy: importing trl takes seconds; `import composer_trl` stays instant.
    if name not in __all__:  # __version__ is set above
        raise AttributeError(f"module 'composer_trl' has no attribute {name!r}")
    module = {"ComposerGRPOConfig": "config", "ComposerGRPOTrainer": "trainer"}.get(name, "sdpo")
    return getattr(import_module(f"composer_trl.{module}"), name)
