"""composer_prime_rl: composer's loss as a PRIME-RL custom rl loss.

Point PRIME-RL's trainer at it::

    [trainer.loss]
    type = "custom"
    import_path = "composer_prime_rl.composer_loss"

    [trainer.loss.kwargs]
    policy_loss = "dppo"

Example configs ship with the package: :func:`example_config` returns their paths.
"""

from importlib.metadata import version as _version
from importlib.resources import as_file, files
from pathlib import Path

from composer_prime_rl.contract import HAS_PRIME_RL, LossInputs, LossOutputs
from composer_prime_rl.loss import composer_loss
from composer_prime_rl.options import PrimeRLLossOptions, parse_options, valid_option_names

__version__ = _version("composer-prime-rl")

EXAMPLES = ("rl.toml", "trainer.toml")


def example_config(name: str = "rl.toml") -> Path:
    """Path of a shipped example config: ``"rl.toml"`` (``uv run rl @ ...``, the combined
    form with ``[trainer.loss]``) or ``"trainer.toml"`` (the standalone ``trainer`` command,
    ``[loss]``)."""
    if name not in EXAMPLES:
        raise ValueError(f"Unknown example {name!r}; choose one of {', '.join(EXAMPLES)}.")
    with as_file(files("composer_prime_rl").joinpath("examples", name)) as path:
        return Path(path)


__all__ = [
    "EXAMPLES",
    "HAS_PRIME_RL",
    "LossInputs",
    "LossOutputs",
    "PrimeRLLossOptions",
    "__version__",
    "composer_loss",
    "example_config",
    "parse_options",
    "valid_option_names",
]
