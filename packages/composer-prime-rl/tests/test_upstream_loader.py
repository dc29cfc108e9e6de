""":func:`prime_rl_upstream.load_upstream` on a checkout, in the environments it meets: PRIME-RL's
loss module imports ``jaxtyping`` and ``beartype``; each is replaced by a stand-in only when that one is
missing (a GPU image often has jaxtyping without beartype), and an installed one is used as it is.

The checkout is a minimal one written here (the real one is not on the package index), with the import lines
of PRIME-RL's ``src/prime_rl/trainer/rl/loss.py``."""

from __future__ import annotations

import importlib.abc
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from prime_rl_upstream import load_upstream

LOSS_PY = """
from beartype import beartype as typechecker
from jaxtyping import Bool, Float, jaxtyped
from torch import Tensor

from prime_rl.configs.trainer import DefaultLossConfig


@jaxtyped(typechecker=typechecker)
def masked_sum(x: Float[Tensor, " seq"], mask: Bool[Tensor, " seq"]) -> Float[Tensor, ""]:
    return (x * mask).sum()


DEFAULTS = DefaultLossConfig()
"""


class _Blocker(importlib.abc.MetaPathFinder):
    """Makes the named top-level modules unimportable, installed or not."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)


def _fake_package(root: Path, name: str, body: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(textwrap.dedent(body))


@pytest.mark.parametrize(
    "installed",
    [(), ("jaxtyping",), ("beartype",), ("jaxtyping", "beartype")],
    ids=lambda t: "+".join(t) or "none",
)
def test_each_annotation_package_is_replaced_only_when_it_is_missing(
    installed: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    checkout = tmp_path / "prime-rl"
    (checkout / "src/prime_rl/trainer/rl").mkdir(parents=True)
    (checkout / "src/prime_rl/trainer/rl/loss.py").write_text(LOSS_PY)
    site = tmp_path / "site"
    _fake_package(
        site,
        "jaxtyping",
        """
        class _T:
            def __class_getitem__(cls, item):
                return cls
        Float = Bool = Int = _T
        def jaxtyped(typechecker=None):
            def wrap(fn):
                fn.checked_by = typechecker
                return fn
            return wrap
        """,
    )
    _fake_package(site, "beartype", "def beartype(fn):\n    return fn\n")
    monkeypatch.syspath_prepend(str(site))
    for name in ("jaxtyping", "beartype"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(
        sys, "meta_path", [_Blocker({"jaxtyping", "beartype"} - set(installed)), *sys.meta_path]
    )

    loss, configs = load_upstream(checkout)

    assert configs.DefaultLossConfig() == loss.DEFAULTS
    x, mask = torch.tensor([1.0, 2.0, 4.0]), torch.tensor([True, False, True])
    assert float(loss.masked_sum(x, mask)) == 5.0
    assert (loss.Float.__module__ == "jaxtyping") == (
        "jaxtyping" in installed
    )  # the installed one, else a stand-in
    assert (loss.typechecker.__module__ == "beartype") == ("beartype" in installed)
    # the stand-ins were only lent for the load
    assert all(n not in sys.modules for n in {"jaxtyping", "beartype"} - set(installed))
