from importlib.metadata import version

import composer_verl


def test_version_matches_distribution_metadata() -> None:
    assert composer_verl.__version__ == version("composer-verl") == "0.1.0"


def test_ships_py_typed() -> None:
    from importlib.resources import files

    assert files("composer_verl").joinpath("py.typed").is_file()
