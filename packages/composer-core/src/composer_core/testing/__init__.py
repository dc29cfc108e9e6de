"""Test helpers shipped with composer_core (pytest-free): naive references and the conformance suite."""
