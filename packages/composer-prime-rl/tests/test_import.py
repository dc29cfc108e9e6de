from importlib.metadata import version

import composer_prime_rl


def test_version_matches_distribution_metadata() -> None:
    assert composer_prime_rl.__version__ == version("composer-prime-rl") == "0.1.0"


def test_ships_py_typed() -> None:
    from importlib.resources import files

    assert files("composer_prime_rl").joinpath("py.typed").is_file()
