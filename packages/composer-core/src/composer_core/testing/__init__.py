"""The conformance suite adapters run against their hosts (pytest-free): :func:`check_adapter`, :data:`CASES`
(:mod:`composer_core.testing.conformance`). Test servers and bench helpers are not shipped: they live in
composer-core's ``tests/support/composer_testkit`` (CONTRIBUTING.md)."""

from composer_core.testing.conformance import *  # noqa: F403  (the suite is this package's whole API)
from composer_core.testing.conformance import __all__ as __all__
