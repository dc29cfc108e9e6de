from importlib.metadata import version

import composer_adapter


def test_version_matches_distribution_metadata() -> None:
    assert composer_adapter.__version__ == version("composer-adapter")


def test_ships_py_typed() -> None:
    from importlib.resources import files

    assert files("composer_adapter").joinpath("py.typed").is_file()
