"""composer-verl: the composer objective inside verl 0.9.

Importing this package does not import verl. The pieces (see the README):

* :mod:`composer_verl.plugin`: the ``verl.plugins`` entry point registering everything below.
* :mod:`composer_verl.advantage`: advantage estimator ``grpo_composer``.
* :mod:`composer_verl.policy_loss`: policy loss ``composer`` (3 channels).
* :mod:`composer_verl.config`: the ``composer:`` section of verl's config (composer's options).
* :mod:`composer_verl.batch`: the ``DataProto`` keys channels 2 and 3 read.
* :mod:`composer_verl.actor` / :mod:`composer_verl.trainer`: the actor extension, ``trainer_mode=composer_sync``.
"""

from importlib.metadata import version as _version

__version__ = _version("composer-verl")

__all__ = ["__version__"]
