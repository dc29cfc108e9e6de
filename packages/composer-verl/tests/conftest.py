"""Shared fixtures for the composer-verl tests (real verl 0.9.1 on CPU)."""

from __future__ import annotations

import pytest
from composer_verl.config import configure


@pytest.fixture(autouse=True)
def _fresh_config(monkeypatch: pytest.MonkeyPatch):
    """Every test starts from default composer options and no COMPOSER_VERL_CONFIG."""
    monkeypatch.delenv("COMPOSER_VERL_CONFIG", raising=False)
    configure(None)
    yield
    configure(None)
