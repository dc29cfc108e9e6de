from importlib.metadata import version

import composer_monarch


def test_version_matches_distribution_metadata() -> None:
    assert composer_monarch.__version__ == version("composer-monarch") == "0.1.0"


def test_ships_py_typed() -> None:
    from importlib.resources import files

    assert files("composer_monarch").joinpath("py.typed").is_file()
