"""Test helpers shipped with composer_core (pytest-free).

- :mod:`composer_core.testing.conformance`: the shared conformance suite adapters run against their hosts
  (:func:`check_adapter`, :data:`CASES`).
- :mod:`composer_core.testing.reference`: naive, fully materialised reference implementations.
- :mod:`composer_core.testing.host_reads`: record aten operators to show a path reads nothing to the host
  (:class:`RecordOps`, :data:`HOST_READS`; used by the device tests of core and the adapters).
- :mod:`composer_core.testing.env_server`: the digit-reversal OpenEnv server as a real process
  (``composer-core[openenv]``; not imported here).
"""

from composer_core.testing.conformance import (
    CASES,
    TAGS,
    ConformanceCase,
    ConformanceError,
    ConformanceReport,
    cases_for,
    check_adapter,
)

__all__ = [
    "CASES",
    "TAGS",
    "ConformanceCase",
    "ConformanceError",
    "ConformanceReport",
    "cases_for",
    "check_adapter",
]
