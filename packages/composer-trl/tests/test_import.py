from importlib.metadata import version

import composer_trl


def test_version_matches_distribution_metadata() -> None:
    assert composer_trl.__version__ == version("composer-trl") == "0.1.0"


def test_ships_py_typed() -> None:
    from importlib.resources import files

    assert files("composer_trl").joinpath("py.typed").is_file()
