from importlib.metadata import version

import composer_core


def test_version_matches_distribution_metadata() -> None:
    assert composer_core.__version__ == version("composer-core") == "0.1.0"


def test_ships_py_typed() -> None:
    from importlib.resources import files

    assert files("composer_core").joinpath("py.typed").is_file()


def test_config_classes_import_from_the_top_level() -> None:
    from composer_core import DPO, TAID, ComposeConfig, EntropyOPD, PolicyOptions, SDPOOptions, SimPO
    from composer_core.loss import config

    top = (ComposeConfig, PolicyOptions, SDPOOptions, DPO, SimPO, TAID, EntropyOPD)
    assert top == tuple(getattr(config, c.__name__) for c in top)
    assert {c.__name__ for c in top} <= set(composer_core.__all__)


def test_every_public_name_is_exported() -> None:
    missing = [name for name in composer_core.__all__ if not hasattr(composer_core, name)]
    assert not missing


def test_import_pulls_in_torch_only() -> None:
    """``import composer_core`` stays light: no optional extra (HF, datasets, plotting, HTTP) is imported."""
    import subprocess
    import sys

    heavy = ("transformers", "datasets", "httpx", "matplotlib", "pandas", "pyarrow", "yaml", "trl", "verl")
    code = f"import sys, composer_core; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_test_support_is_not_shipped() -> None:
    """The installed package ships the conformance suite only; test servers and bench helpers are the
    never-shipped ``composer_testkit`` in tests/support (CONTRIBUTING.md, Test support)."""
    import pkgutil
    from pathlib import Path

    import composer_core.testing

    assert {m.name for m in pkgutil.iter_modules(composer_core.testing.__path__)} == {"conformance"}
    import composer_testkit

    assert Path(composer_testkit.__file__).parent.parent == Path(__file__).parent / "support"
