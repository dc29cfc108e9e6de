from importlib.metadata import version

import composer_core


def test_version_matches_distribution_metadata() -> None:
    assert composer_core.__version__ == version("composer-core") == "0.1.0"


def test_ships_py_typed() -> None:
    from importlib.resources import files

    assert files("composer_core").joinpath("py.typed").is_file()
