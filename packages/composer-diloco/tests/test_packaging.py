"""The DiLoCo math imports without the optional extras; missing extras name themselves."""

from __future__ import annotations

import subprocess
import sys

import pytest
from composer_diloco._optional import require

BLOCK = "import sys\nfor m in ('ray', 's3fs', 'gcsfs', 'transformers', 'moto'):\n    sys.modules[m] = None\n"


def test_core_imports_without_ray_s3fs_transformers() -> None:
    code = BLOCK + (
        "import composer_diloco as c\n"
        "from composer_diloco import DiLoCoConfig, build_diloco, ObjectStoreAllReduce, ObjectStoreManager, train_diloco\n"
        "from composer_diloco.fault_tolerant import Lighthouse, make_manager\n"
        "try:\n    c.RayExecutor()\nexcept ImportError as e:\n    print('RAY:', e)\n"
        "try:\n    c.DiLoCoCallback\nexcept ImportError as e:\n    print('TRL:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "composer-diloco[ray]" in out.stdout and "composer-diloco[trl]" in out.stdout


def test_require_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"pip install 'composer-diloco\[s3\]'"):
        require("definitely_not_installed_module", "s3", "s3:// stores")
