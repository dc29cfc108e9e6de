"""TRL's own trainer tests with composer's classes swapped in: every test that passes for TRL's trainer passes for
composer's (``tests/upstream/derive.py`` derives both trees from a TRL checkout; nothing of TRL's is committed).

TRL ships no tests in its sdist or wheel (``trl-1.16.0.tar.gz`` checked) and CI has no network, so this needs a
checkout of https://github.com/huggingface/trl: ``COMPOSER_TRL_UPSTREAM=<checkout>`` (revision
``COMPOSER_TRL_UPSTREAM_REV``, default ``derive.DEFAULT_REV``). Without it the test is skipped. Each file runs twice
in a subprocess (TRL's trainer, then composer's): the SDPO file whole (8-12 min per run on 2 busy CPU cores), the GRPO file
on the named subset ``GRPO_SUBSET``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

UPSTREAM = os.environ.get("COMPOSER_TRL_UPSTREAM")
HERE = Path(__file__).parent / "upstream"
#: the GRPO tests run here (each of TRL's training tests runs 3 epochs of its dataset: 2-4 min on 2 CPU cores, so
#: only two of them): construction (minimal, remote code, every eval-dataset form), both dataset formats trained,
#: and the static helpers called on composer's class (entropy mask and threshold, off-policy mask)
GRPO_SUBSET = (
    "test_init_minimal or test_trust_remote_code or test_init_with_eval_dataset or test_train_dataset_format"
    " or test_get_off_policy_mask or test_compute_entropy"
)
pytestmark = pytest.mark.skipif(
    UPSTREAM is None,
    reason="TRL's tests are not in its sdist/wheel and CI has no network: set COMPOSER_TRL_UPSTREAM=<trl checkout>",
)


def _derive() -> Any:
    spec = importlib.util.spec_from_file_location("composer_trl_upstream_derive", HERE / "derive.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    derive = _derive()
    out = tmp_path_factory.mktemp("trl-upstream")
    rev = os.environ.get("COMPOSER_TRL_UPSTREAM_REV", derive.DEFAULT_REV)
    roots: dict[str, Path] = derive.derive(out, Path(str(UPSTREAM)), rev)
    return roots


def outcomes(root: Path, path: str, select: str | None = None) -> dict[str, str]:
    """``{test id: passed | failed | skipped}`` of one derived file run in a fresh interpreter."""
    report = root / f"{Path(path).stem}.xml"
    cmd = [sys.executable, "-m", "pytest", "-c", str(root / "pytest.ini"), path, "-q", "-W", "ignore"]
    cmd += ["--junitxml", str(report), "-p", "no:randomly", *(["-k", select] if select else [])]
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "COMPOSER_HUB_STANDINS": str(root.parent / "hub")}
    subprocess.run(cmd, cwd=root, env=env, capture_output=True, timeout=3000, check=False)
    result = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case} & {"failure", "error", "skipped"}
        state = "skipped" if "skipped" in kinds else ("failed" if kinds else "passed")
        result[f"{case.get('classname')}::{case.get('name')}"] = state
    return result


@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    ("path", "select"),
    [("tests/experimental/test_sdpo_trainer.py", None), ("tests/test_grpo_trainer.py", GRPO_SUBSET)],
    ids=["sdpo", "grpo-subset"],
)
def test_trl_tests_pass_with_composer_swapped_in(
    trees: dict[str, Path], path: str, select: str | None
) -> None:
    trl = outcomes(trees["trl"], path, select)
    composer = outcomes(trees["composer"], path, select)
    passed = sorted(t for t, s in trl.items() if s == "passed")
    assert passed, f"no test of {path} passed for TRL's own trainer: the stand-ins are broken"
    lost = [t for t in passed if composer.get(t) != "passed"]
    assert not lost, f"{len(lost)} of the {len(passed)} tests that pass for TRL fail for composer: {lost}"
    print(
        f"{path}: TRL {len(passed)}/{len(trl)} passed, composer {sum(s == 'passed' for s in composer.values())}"
    )
