"""Crash-safe checkpoints: ``step-N/``, ``best/``, ``final/`` and a ``latest`` link.

A checkpoint is written into ``<name>.partial/``: each rank writes its own blocks'
optimizer+scaler state (``optim/block-i.pt``) and weights (``blocks/block-i.safetensors``)
and its RNG state; rank 0 writes the non-block weights (``shared.safetensors``) and
``state.json`` (step, explicit ``batches_consumed``, history). The completion marker
``COMPLETE`` is written last, then the directory is renamed into place (an older one of the
same name is moved out first, so a re-save never keeps stale optimizer state), then
``latest`` is repointed atomically (temporary symlink + ``os.replace``).

On resume only marked ``step-*``/``final`` directories count; unmarked, ``.partial`` and
``.old`` ones are moved to ``aside/`` with a warning. ``best`` is never resumed from.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from composer_core.bypass.distributed import DistContext
from composer_core.bypass.optim import BlockOptimizer
from composer_core.bypass.protocol import BlockwiseModel

MARKER = "COMPLETE"
STATE = "state.json"
MANIFEST = "bypass_state.json"
LATEST = "latest"
KILL_ENV = "COMPOSER_BYPASS_KILL_AT"


def _fault_point(name: str, phase: str) -> None:
    """Test hook: ``COMPOSER_BYPASS_KILL_AT=<checkpoint>:<phase>`` SIGKILLs this process here."""
    if os.environ.get(KILL_ENV) == f"{name}:{phase}":
        os.kill(os.getpid(), signal.SIGKILL)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def block_state(model: BlockwiseModel, index: int) -> dict[str, Tensor]:
    prefix = model.block_prefix(index)
    return {k[len(prefix) :]: v for k, v in model.module.state_dict().items() if k.startswith(prefix)}


def shared_state(model: BlockwiseModel) -> dict[str, Tensor]:
    prefixes = tuple(model.block_prefix(i) for i in range(model.num_blocks))
    return {k: v for k, v in model.module.state_dict().items() if not k.startswith(prefixes)}


def _save_tensors(tensors: Mapping[str, Tensor], path: Path) -> None:
    # clone: tied weights share storage, which safetensors refuses to write twice
    save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}, str(path))


def save_checkpoint(
    exp_dir: Path,
    name: str,
    *,
    model: BlockwiseModel,
    blocks: Sequence[int],
    optimizers: Mapping[int, BlockOptimizer],
    state: Mapping[str, Any],
    ctx: DistContext,
    update_latest: bool = True,
) -> Path:
    """Write checkpoint ``name`` (every rank calls this; each writes only its own blocks)."""
    final = exp_dir / name
    partial = exp_dir / f"{name}.partial"
    if ctx.is_main:
        if partial.exists():
            shutil.rmtree(partial)
        for sub in ("blocks", "optim", "rng"):
            (partial / sub).mkdir(parents=True)
    ctx.barrier()
    for i in blocks:
        if i in optimizers:
            torch.save(optimizers[i].state_dict(), partial / "optim" / f"block-{i:04d}.pt")
    _fault_point(name, "optimizer")
    for i in blocks:
        _save_tensors(block_state(model, i), partial / "blocks" / f"block-{i:04d}.safetensors")
    _fault_point(name, "blocks")
    torch.save({"cpu": torch.get_rng_state()}, partial / "rng" / f"rank-{ctx.rank:04d}.pt")
    ctx.barrier()
    if ctx.is_main:
        _save_tensors(shared_state(model), partial / "shared.safetensors")
        write_json_atomic(partial / STATE, dict(state))
        _fault_point(name, "state")
        with open(partial / MARKER, "w") as f:
            f.write("complete\n")
            f.flush()
            os.fsync(f.fileno())
        _fault_point(name, "marker")
        old = exp_dir / f"{name}.old"
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        partial.rename(final)
        _fault_point(name, "rename")
        if old.exists():
            shutil.rmtree(old)
        if update_latest:
            tmp = exp_dir / f".{LATEST}.tmp-{os.getpid()}"
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            os.symlink(name, tmp)
            os.replace(tmp, exp_dir / LATEST)
    ctx.barrier()
    return final


def _set_aside(exp_dir: Path, path: Path, why: str) -> None:
    aside = exp_dir / "aside"
    aside.mkdir(exist_ok=True)
    n = 0
    while (target := aside / f"{path.name}-{n}").exists():
        n += 1
    path.rename(target)
    warnings.warn(f"bypass: {path.name}: {why}; moved it to {target} (never loaded)", stacklevel=3)


def set_aside_checkpoints(exp_dir: Path, why: str) -> None:
    """Move every checkpoint directory of ``exp_dir`` to ``aside/`` (a restart must not resume from them)."""
    for path in sorted(exp_dir.iterdir()):
        if (
            path.is_dir()
            and not path.is_symlink()
            and (path.name.startswith("step-") or path.name.split(".")[0] in ("final", "best"))
        ):
            _set_aside(exp_dir, path, why)
    if (exp_dir / LATEST).is_symlink():
        (exp_dir / LATEST).unlink()


def read_state(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / STATE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"checkpoint {path} has an unreadable {STATE}: {exc}; delete or move the directory"
        ) from exc
    if not isinstance(data, dict) or not {"step", "batches_consumed"} <= set(data):
        raise ValueError(
            f"checkpoint {path}/{STATE} lacks step/batches_consumed; delete or move the directory"
        )
    return data


def find_resume_checkpoint(exp_dir: Path) -> Path | None:
    """Rank 0: the newest complete ``step-*``/``final`` checkpoint; incomplete ones are set aside."""
    if not exp_dir.is_dir():
        return None
    best: tuple[int, int, Path] | None = None
    for path in sorted(exp_dir.iterdir()):
        if not path.is_dir() or path.is_symlink() or path.name == "aside":
            continue
        if path.name.endswith((".partial", ".old")):
            _set_aside(exp_dir, path, "an interrupted save")
            continue
        if not (path.name.startswith("step-") or path.name in ("final", "best")):
            continue
        if not is_complete(path):
            _set_aside(exp_dir, path, f"missing its {MARKER} marker")
            continue
        if path.name == "best":
            continue
        state = read_state(path)
        key = (int(state["batches_consumed"]), 1 if path.name == "final" else 0, path)
        if best is None or key[:2] > best[:2]:
            best = key
    return None if best is None else best[2]


def load_checkpoint(
    path: Path,
    *,
    model: BlockwiseModel,
    blocks: Sequence[int],
    optimizers: Mapping[int, BlockOptimizer] | None,
    ctx: DistContext,
    load_shared: bool = True,
) -> dict[str, Any]:
    """Load this rank's blocks (and optimizers, RNG) from ``path``; return ``state.json``."""
    if not is_complete(path):
        raise ValueError(f"checkpoint {path} has no {MARKER} marker; it is incomplete and will not be loaded")
    state = read_state(path)
    expected = model.module.state_dict()
    updates: dict[str, Tensor] = {}
    files = [(model.block_prefix(i), path / "blocks" / f"block-{i:04d}.safetensors") for i in blocks]
    if load_shared:
        files.append(("", path / "shared.safetensors"))
    for prefix, file in files:
        try:
            tensors = load_file(str(file))
        except Exception as exc:
            raise ValueError(f"checkpoint file {file} is missing or corrupt: {exc}") from exc
        for k, v in tensors.items():
            full = prefix + k
            if full not in expected or expected[full].shape != v.shape:
                raise ValueError(
                    f"checkpoint {file}: tensor {k!r} {tuple(v.shape)} does not fit the student "
                    "(was it written for another student config?)"
                )
            updates[full] = v
    missing = [k for k in expected if k.startswith(tuple(p for p, _ in files if p)) and k not in updates]
    if missing:
        raise ValueError(f"checkpoint {path} lacks student tensors {missing[:5]}")
    with torch.no_grad():
        for k, v in updates.items():
            expected[k].copy_(v)
    for i, opt in (optimizers or {}).items():
        file = path / "optim" / f"block-{i:04d}.pt"
        try:
            opt.load_state_dict(torch.load(file, weights_only=True))
        except Exception as exc:
            raise ValueError(f"optimizer state {file} is missing or corrupt: {exc}") from exc
    rng = path / "rng" / f"rank-{ctx.rank:04d}.pt"
    if optimizers is not None and rng.is_file():  # only when resuming training
        torch.set_rng_state(torch.load(rng, weights_only=True)["cpu"])
    return state
