"""Derive TRL's own trainer tests with composer's classes swapped in, by a recorded, automated edit.

TRL's tests are not in its sdist or wheel (checked: ``trl-1.16.0.tar.gz`` ships none), so they are read from a git
checkout of https://github.com/huggingface/trl (``--trl-repo``, revision ``--rev``); nothing of upstream's is
committed here. For each file of ``FILES`` two trees are written under ``OUT``:

- ``OUT/trl``: upstream's file as is (the baseline: what passes for TRL's own trainer here);
- ``OUT/composer``: the same file after ``FILES[...].swap``: the import of TRL's trainer and config replaced by
  composer's, and every bare use of the two names renamed (``SDPOTrainer`` → ``ComposerSDPOTrainer``, ...). Names
  in strings and attribute paths (``trl.trainer.grpo_trainer.GRPOTrainer``) are left alone.

Both trees get upstream's ``tests/testing_utils.py`` (one edit: names this trl's ``import_utils`` lacks read as
unavailable), a ``conftest.py`` that runs every test inside the local Hub stand-ins (:mod:`hub_standins`) and a
``pytest.ini``. Each edit must apply exactly as often as recorded, else the derivation fails (upstream changed).

    python tests/upstream/derive.py OUT --trl-repo /path/to/trl [--rev REV]
    pytest -c OUT/composer/pytest.ini OUT/composer/tests/experimental/test_sdpo_trainer.py
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
DEFAULT_REV = "f2cd57710"  # huggingface/trl main, 2026-07-24: the newest revision at hand (1.16's tag is not)


@dataclass(frozen=True)
class Swap:
    import_line: str  # upstream's import of the trainer and config
    replacement: str  # composer's
    names: dict[str, str]  # bare-name renames


FILES = {
    "tests/experimental/test_sdpo_trainer.py": Swap(
        "from trl.experimental.sdpo import SDPOConfig, SDPOTrainer\n",
        "from composer_trl import ComposerSDPOConfig, ComposerSDPOTrainer\n",
        {"SDPOTrainer": "ComposerSDPOTrainer", "SDPOConfig": "ComposerSDPOConfig"},
    ),
    "tests/test_grpo_trainer.py": Swap(
        "from trl import GRPOConfig, GRPOTrainer\n",
        "from composer_trl import ComposerGRPOConfig, ComposerGRPOTrainer\n",
        {"GRPOTrainer": "ComposerGRPOTrainer", "GRPOConfig": "ComposerGRPOConfig"},
    ),
}
_IMPORT_UTILS = re.compile(r"from trl\.import_utils import \(\n((?:    \w+,\n)+)\)\n")
PYTEST_INI = "[pytest]\naddopts = -p no:cacheprovider\nfilterwarnings = ignore::DeprecationWarning\n"


def _show(repo: Path, rev: str, path: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "show", f"{rev}:{path}"], check=True, capture_output=True, text=True
    ).stdout


def swap(source: str, spec: Swap) -> str:
    """Upstream's test file with composer's trainer and config (raises if upstream's import is not there)."""
    if source.count(spec.import_line) != 1:
        raise ValueError(f"upstream no longer imports {spec.import_line.strip()!r} once: update derive.py")
    body = source.replace(spec.import_line, "\0")
    for old, new in spec.names.items():
        body = re.sub(rf"(?<![\w.\"']){old}\b", new, body)
    return body.replace("\0", spec.replacement)


def tolerant_testing_utils(source: str) -> str:
    """``from trl.import_utils import (a, b, ...)`` → each name read with ``getattr``, absent ones unavailable."""
    match = _IMPORT_UTILS.search(source)
    if match is None:
        raise ValueError("upstream testing_utils no longer imports from trl.import_utils as expected")
    names = re.findall(r"\w+", match.group(1))
    lines = "import trl.import_utils as _iu\n\n" + "".join(
        f"{n} = getattr(_iu, {n!r}, lambda: False)\n" for n in names
    )
    return source[: match.start()] + lines + source[match.end() :]


def derive(out: Path, repo: Path, rev: str = DEFAULT_REV) -> dict[str, Path]:
    """Write ``out/trl`` and ``out/composer``; return their roots."""
    utils = tolerant_testing_utils(_show(repo, rev, "tests/testing_utils.py"))
    roots = {}
    for flavour in ("trl", "composer"):
        root = out / flavour
        shutil.rmtree(root, ignore_errors=True)
        (root / "tests" / "experimental").mkdir(parents=True)
        (root / "tests" / "__init__.py").write_text("")
        (root / "tests" / "experimental" / "__init__.py").write_text("")
        (root / "tests" / "testing_utils.py").write_text(utils)
        shutil.copy(HERE / "derived_conftest.py", root / "tests" / "conftest.py")
        shutil.copy(HERE / "hub_standins.py", root / "hub_standins.py")
        (root / "pytest.ini").write_text(PYTEST_INI)
        for path, spec in FILES.items():
            source = _show(repo, rev, path)
            (root / path).write_text(source if flavour == "trl" else swap(source, spec))
        roots[flavour] = root
    return roots


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--trl-repo", type=Path, required=True, help="a git checkout of huggingface/trl")
    parser.add_argument("--rev", default=DEFAULT_REV)
    ns = parser.parse_args()
    for name, root in derive(ns.out, ns.trl_repo, ns.rev).items():
        print(f"{name}: {root}")
