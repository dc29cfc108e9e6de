"""Shared fixtures for the composer-verl tests (real verl 0.9.1 on CPU)."""

from __future__ import annotations

import pytest
from composer_verl.config import configure


@pytest.fixture(autouse=True)
def _fresh_config():
    """Every test starts from default composer options."""
    configure(None)
    yield
    configure(None)
