"""``python -m composer_prime_rl.check <config.toml> [--trainer.loss.kwargs.KEY VALUE ...]``

``python -m composer_prime_rl.check --example rl.toml|trainer.toml`` prints a shipped example config to stdout.

Validates the composer loss options of a PRIME-RL config **before training** (PRIME-RL itself would only call
the loss, and so only find a bad option, at the first training step, after the model has loaded).

The config is either the combined ``rl`` form (loss table ``[trainer.loss]``) or the standalone ``trainer``
form (``[loss]``); ``type = "custom"`` with ``import_path = "composer_prime_rl.composer_loss"`` must be set and
its ``kwargs`` table is validated exactly as ``composer_loss`` will (CLI-style string values are coerced the
same way). Overrides as PRIME-RL's command line passes them (``--trainer.loss.kwargs.alpha_sdpo 0.25`` or
``--loss.kwargs.alpha_sdpo 0.25``) are applied first, as strings.

Exit codes: 0 the options are valid (one line summarising them on stdout); 2 a bad config (one line on stderr
naming the key and the fix; also for an unreadable file or a config that does not use composer's loss).
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from composer_prime_rl import example_config
from composer_prime_rl.options import PrimeRLLossOptions, parse_options

__all__ = ["check_config", "main"]

IMPORT_PATH = "composer_prime_rl.composer_loss"
EXIT_OK = 0
EXIT_BAD_CONFIG = 2


class ConfigError(ValueError):
    """A config problem, reported as one line with exit code 2."""


def _loss_table(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    trainer = config.get("trainer")
    if isinstance(trainer, dict) and isinstance(trainer.get("loss"), dict):
        return "trainer.loss", trainer["loss"]
    if isinstance(config.get("loss"), dict):
        return "loss", config["loss"]
    raise ConfigError(
        "no [trainer.loss] (rl config) or [loss] (trainer config) table; add one with "
        f'type = "custom" and import_path = "{IMPORT_PATH}".'
    )


def _overrides(args: Sequence[str]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    it = iter(args)
    for flag in it:
        key = flag.removeprefix("--trainer.loss.kwargs.").removeprefix("--loss.kwargs.")
        if key in (flag, ""):
            raise ConfigError(
                f"unexpected argument {flag!r}; overrides look like --trainer.loss.kwargs.KEY VALUE "
                "(or --loss.kwargs.KEY VALUE)."
            )
        key, eq, value = key.partition("=")
        if not eq:
            value = next(it, None)  # type: ignore[assignment]
            if value is None:
                raise ConfigError(f"{flag} needs a value.")
        out.append((key, value))
    return out


def check_config(path: str | Path, overrides: Sequence[str] = ()) -> PrimeRLLossOptions:
    """Load a PRIME-RL TOML, apply CLI-style overrides, validate its composer loss kwargs; ``ConfigError`` or
    ``ValueError`` (from :func:`composer_prime_rl.parse_options`) for a bad config."""
    try:
        config = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(
            f"cannot read {path}: {err.strerror or err}; pass the path of a PRIME-RL TOML."
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML ({err}); fix the syntax.") from None
    where, loss = _loss_table(config)
    if loss.get("type") != "custom" or loss.get("import_path") != IMPORT_PATH:
        raise ConfigError(
            f"[{where}] does not select composer's loss (type = {loss.get('type')!r}, import_path = "
            f'{loss.get("import_path")!r}); set type = "custom" and import_path = "{IMPORT_PATH}".'
        )
    kwargs = loss.get("kwargs", {})
    if not isinstance(kwargs, dict):
        raise ConfigError(f"[{where}.kwargs] must be a table of options, got {type(kwargs).__name__}.")
    kwargs = {**kwargs, **dict(_overrides(overrides))}
    try:
        return parse_options(kwargs)
    except ValueError as err:
        raise ConfigError(f"[{where}.kwargs] {err}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0].strip("`"), file=sys.stderr if not args else sys.stdout)
        return EXIT_OK if args else EXIT_BAD_CONFIG
    try:
        if args[0] == "--example":  # the shipped example config on stdout: `... --example rl.toml > rl.toml`
            print(example_config(args[1] if len(args) > 1 else "rl.toml").read_text(encoding="utf-8"), end="")
            return EXIT_OK
        opts = check_config(args[0], args[1:])
    except ValueError as err:
        print(f"{args[0]}: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(f"{args[0]}: ok ({opts})")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
