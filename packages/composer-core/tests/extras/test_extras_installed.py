import importlib

import pytest


@pytest.mark.parametrize("module", ["transformers", "tokenizers", "httpx", "matplotlib", "yaml", "pyarrow"])
def test_all_extra_installs_its_modules(module: str) -> None:
    importlib.import_module(module)
