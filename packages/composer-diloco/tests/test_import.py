from importlib.metadata import version

import composer_diloco


def test_version_matches_distribution_metadata() -> None:
    assert composer_diloco.__version__ == version("composer-diloco") == "0.1.0"


def test_ships_py_typed() -> None:
    from importlib.resources import files

    assert files("composer_diloco").joinpath("py.typed").is_file()
