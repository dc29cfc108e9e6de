"""verl plugin: registers the ``grpo_composer`` advantage estimator, the ``composer`` policy loss and (lazily) the
``composer_sync`` trainer mode; the README's "How registration reaches every process" says how it is imported and
why a failure here is loud. verl calls plugins while ``verl/__init__`` still runs, so
``verl.trainer.ppo.core_algos`` is imported only inside :func:`register`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
import warnings
from types import ModuleType
from typing import Any

logger = logging.getLogger("composer_verl")

TRAINER_PACKAGE = "verl.trainer.ppo.v1"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Register the trainer mode right after verl's v1 trainer package has executed (one shot, then it removes
    itself)."""

    target = TRAINER_PACKAGE

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            _register_trainer()

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def _register_trainer() -> None:
    importlib.import_module("composer_verl.trainer")  # registers trainer_mode=composer_sync


def register() -> None:
    """Register composer's estimator, loss and (lazily) trainer mode in verl's registries (idempotent)."""
    from verl.trainer.ppo import core_algos

    from composer_verl.advantage import ESTIMATOR_NAME, compute_grpo_composer_advantage
    from composer_verl.policy_loss import LOSS_NAME, compute_policy_loss_composer

    # register_adv_est refuses to rebind a name to a different function; the functions live in
    # normal modules, so importing this plugin twice (entry point + VERL_USE_EXTERNAL_MODULES) is fine.
    core_algos.register_adv_est(ESTIMATOR_NAME)(compute_grpo_composer_advantage)
    core_algos.register_policy_loss(LOSS_NAME)(compute_policy_loss_composer)

    # The trainer mode needs verl's v1 trainer (ray, transfer_queue, ...): register it only once
    # something imports that package (the TaskRunner does), never at `import verl` time.
    if TRAINER_PACKAGE in sys.modules:
        _register_trainer()
    elif not any(
        getattr(f, "target", None) == TRAINER_PACKAGE for f in sys.meta_path
    ):  # one hook, even on reload
        sys.meta_path.insert(0, _AfterImport())


try:
    register()
except Exception as exc:  # verl would swallow this at DEBUG level: make it loud, then re-raise.
    message = (
        f"composer-verl could not register its verl plugin ({type(exc).__name__}: {exc}); "
        "adv_estimator=grpo_composer and loss_mode=composer will be unavailable."
    )
    logger.error(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    raise
