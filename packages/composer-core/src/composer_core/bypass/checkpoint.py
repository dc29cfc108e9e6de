"""Crash-safe checkpoints: ``step-N/``, ``best/``, ``final/`` and a ``latest`` link.

Layout, atomic publication (``<name>.partial/``, then the ``COMPLETE`` marker holding every other file's
SHA-256, then a rename), resume and the handling of corrupt checkpoints: the README's "Bypass engine",
*Checkpoints*. A file that cannot be written raises :class:`OutputWriteError`.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import signal
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from composer_core.bypass.distributed import DistContext
from composer_core.bypass.optim import BlockOptimizer
from composer_core.bypass.protocol import BlockwiseModel
from composer_core.bypass.shard import name_owner

MARKER = "COMPLETE"
STATE = "state.json"
MANIFEST = "bypass_state.json"
LATEST = "latest"
KILL_ENV = "COMPOSER_BYPASS_KILL_AT"
MARKER_FORMAT = 1


class OutputWriteError(OSError):
    """An output file could not be written; ``filename`` and ``strerror`` name the path and cause."""


def _write_error(exc: OSError, path: Path) -> OutputWriteError:
    code = exc.errno if exc.errno is not None else errno.EIO
    return OutputWriteError(code, os.strerror(code), exc.filename or str(path))


def write_file(path: Path, data: bytes | memoryview) -> str:
    """Write ``data`` to ``path`` durably (fsync); returns its SHA-256. An OSError names the file."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise _write_error(exc, path) from exc
    return hashlib.sha256(data).hexdigest()


def _torch_save(obj: Any, path: Path) -> str:
    # serialised in memory: torch.save reports a full disk as a RuntimeError without errno
    buf = io.BytesIO()
    torch.save(obj, buf)
    return write_file(path, buf.getbuffer())


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
    write_file(tmp, json.dumps(data, indent=1, sort_keys=True).encode())
    os.replace(tmp, path)


def save_tensors(tensors: Mapping[str, Tensor], path: Path, metadata: dict[str, str] | None = None) -> str:
    # clone: tied weights share storage, which safetensors refuses to write twice; serialised in
    # memory: safetensors' own writer reports a full disk without errno or path
    data = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    return write_file(path, safetensors_bytes(data, metadata=metadata))


def verify_files(path: Path, files: Sequence[str] | None = None) -> str | None:
    """None when ``files`` (default: all listed in the marker) match their checksums, else the problem."""
    try:
        text = (path / MARKER).read_text()
        if text.strip() == "complete":
            return None  # written before checksums existed: nothing to verify against
        sums = json.loads(text)["sha256"]
        if not isinstance(sums, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return f"unreadable {MARKER} marker"
    for rel in files if files is not None else sorted(sums):
        if rel not in sums:
            return f"{rel} is not listed in {MARKER}"
        try:
            with open(path / rel, "rb") as f:
                got = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as exc:
            return f"{rel} is unreadable ({exc.strerror or exc})"
        if got != sums[rel]:
            return f"{rel} fails its SHA-256 check (bit rot or a torn write)"
    return None


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
    """Write checkpoint ``name`` (every rank calls this; each writes only its own blocks).

    Raises :class:`OutputWriteError` when a file cannot be written (disk full, read-only, ...).
    """
    partial = exp_dir / f"{name}.partial"
    try:
        if ctx.is_main:
            if partial.exists():
                shutil.rmtree(partial)
            for sub in ("blocks", "optim", "rng"):
                (partial / sub).mkdir(parents=True)
        ctx.barrier()
        everyone = ctx.gather(_write_rank_files(partial, name, model, blocks, optimizers, ctx))
        if ctx.is_main:  # every rank's files are durable past the gather
            files = {k: v for part in everyone for k, v in part.items()}
            files[STATE] = write_file(
                partial / STATE, json.dumps(dict(state), indent=1, sort_keys=True).encode()
            )
            _fault_point(name, "state")
            marker = {"format": MARKER_FORMAT, "sha256": files}
            write_file(partial / MARKER, json.dumps(marker, indent=1, sort_keys=True).encode())
            _fault_point(name, "marker")
            _publish(exp_dir, name, partial, update_latest)
    except OutputWriteError:
        raise
    except OSError as exc:
        raise _write_error(exc, partial) from exc
    ctx.barrier()
    return exp_dir / name


def _write_rank_files(
    partial: Path,
    name: str,
    model: BlockwiseModel,
    blocks: Sequence[int],
    optimizers: Mapping[int, BlockOptimizer],
    ctx: DistContext,
) -> dict[str, str]:
    """Write this rank's files of the checkpoint (fsynced); their checksums by relative path."""
    sums: dict[str, str] = {}
    for i in blocks:
        if i in optimizers:
            rel = f"optim/block-{i:04d}.pt"
            sums[rel] = _torch_save(optimizers[i].state_dict(), partial / rel)
    _fault_point(name, "optimizer")
    for i in blocks:
        rel = f"blocks/block-{i:04d}.safetensors"
        prefix = model.block_prefix(i)
        state = {k[len(prefix) :]: v for k, v in model.module.state_dict().items() if k.startswith(prefix)}
        sums[rel] = save_tensors(state, partial / rel)
    _fault_point(name, "blocks")
    prefixes = tuple(model.block_prefix(i) for i in range(model.num_blocks))
    shared = {  # the non-block tensors this rank owns (embedding: first rank, the rest: last)
        k: v
        for k, v in model.module.state_dict().items()
        if not k.startswith(prefixes) and not v.is_meta and name_owner(model, k, ctx.world_size) == ctx.rank
    }
    rel = "shared.safetensors" if ctx.is_main else f"shared-rank-{ctx.rank:04d}.safetensors"
    if shared or ctx.is_main:
        sums[rel] = save_tensors(shared, partial / rel)
    rel = f"rng/rank-{ctx.rank:04d}.pt"
    sums[rel] = _torch_save({"cpu": torch.get_rng_state()}, partial / rel)
    for sub in ("blocks", "optim", "rng", "."):
        fd = os.open(partial / sub, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return sums


def _publish(exp_dir: Path, name: str, partial: Path, update_latest: bool) -> None:
    """Rename the complete ``partial`` into place (the previous one set aside, then removed) and point
    ``latest`` at it."""
    final, old = exp_dir / name, exp_dir / f"{name}.old"
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


def _set_aside(exp_dir: Path, path: Path, why: str, tag: str = "") -> Path:
    aside = exp_dir / "aside"
    aside.mkdir(exist_ok=True)
    n = 0
    while (target := aside / f"{path.name}{tag}-{n}").exists():
        n += 1
    path.rename(target)
    warnings.warn(f"bypass: {path.name}: {why}; moved it to {target} (never loaded)", stacklevel=3)
    return target


def set_aside_corrupt(exp_dir: Path, path: Path, problem: str) -> Path:
    """Move a corrupt checkpoint to ``aside/<name>.corrupt-<UTC time>-<n>`` with a warning."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return _set_aside(exp_dir, path, f"corrupt: {problem}", tag=f".corrupt-{stamp}")


def prune_checkpoints(exp_dir: Path, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete ``step-*`` checkpoints (``best``/``final`` kept).

    Each is renamed to ``<name>.deleting`` first, so a kill mid-delete never leaves a
    half-deleted directory that looks like a checkpoint. Returns the deleted names.
    """
    if keep_last < 1:
        return []
    steps = sorted(
        p for p in exp_dir.iterdir()
        if re.fullmatch(r"step-\d+", p.name) and p.is_dir() and not p.is_symlink() and is_complete(p)
    )  # fmt: skip
    removed = []
    for path in steps[:-keep_last]:
        doomed = path.with_name(f"{path.name}.deleting")
        path.rename(doomed)
        shutil.rmtree(doomed)
        removed.append(path.name)
    return removed


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


def read_json(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in ``path``; a ValueError naming the file and ``fix`` when it is unreadable or no object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, not UTF-8
        raise ValueError(f"{path.parent} has an unreadable {path.name} ({exc}); {fix}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object; {fix}")
    return data


def read_state(path: Path) -> dict[str, Any]:
    data = read_json(path / STATE, "delete or move the checkpoint directory")
    if not {"step", "batches_consumed"} <= set(data):
        raise ValueError(
            f"checkpoint {path}/{STATE} lacks step/batches_consumed; delete or move the directory"
        )
    return data


def find_resume_checkpoint(exp_dir: Path) -> Path | None:
    """Rank 0: the newest complete *and intact* ``step-*``/``final`` checkpoint.

    Incomplete ones are set aside; complete ones are tried newest first and verified against
    their marker's checksums; a corrupt one is set aside (``.corrupt-<time>``) and the next
    older one is tried.
    """
    if not exp_dir.is_dir():
        return None
    candidates: list[tuple[tuple[int, int], Path]] = []
    for path in sorted(exp_dir.iterdir()):
        if not path.is_dir() or path.is_symlink() or path.name == "aside":
            continue
        if path.name.endswith(".deleting"):  # a pruned checkpoint whose deletion was interrupted
            shutil.rmtree(path)
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
        try:
            state = read_state(path)
        except ValueError as exc:
            set_aside_corrupt(exp_dir, path, str(exc))
            continue
        candidates.append(((int(state["batches_consumed"]), 1 if path.name == "final" else 0), path))
    for _, path in sorted(candidates, key=lambda c: c[0], reverse=True):
        problem = verify_files(path)
        if problem is None:
            return path
        set_aside_corrupt(exp_dir, path, problem)
    return None


def _shared_files(path: Path, wanted: set[str]) -> list[str]:
    """The non-block files holding any of the tensors ``wanted`` (only the headers are read)."""
    out = []
    for f in sorted(path.glob("shared*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as handle:
                if wanted & set(handle.keys()):
                    out.append(f.name)
        except Exception as exc:
            raise ValueError(f"checkpoint file {f} is corrupt: {exc}") from exc
    return out


def load_checkpoint(
    path: Path,
    *,
    model: BlockwiseModel,
    blocks: Sequence[int],
    optimizers: Mapping[int, BlockOptimizer] | None,
    ctx: DistContext,
) -> dict[str, Any]:
    """Load this rank's blocks (and optimizers, RNG) from ``path``; return ``state.json``."""
    if not is_complete(path):
        raise ValueError(f"checkpoint {path} has no {MARKER} marker; it is incomplete and will not be loaded")
    expected = {k: v for k, v in model.module.state_dict().items() if not v.is_meta}
    block_prefixes = tuple(model.block_prefix(i) for i in range(model.num_blocks))
    shared_wanted = {k for k in expected if not k.startswith(block_prefixes)}
    sources = [(f"blocks/block-{i:04d}.safetensors", model.block_prefix(i)) for i in blocks]
    sources += [(rel, "") for rel in _shared_files(path, shared_wanted)]
    mine = [STATE, *(rel for rel, _ in sources), *(f"optim/block-{i:04d}.pt" for i in (optimizers or {}))]
    rng = f"rng/rank-{ctx.rank:04d}.pt"
    resuming = optimizers is not None and (path / rng).is_file()  # the RNG only when resuming training
    problem = verify_files(path, [*mine, rng] if resuming else mine)
    if problem is not None:
        raise ValueError(f"checkpoint {path} is corrupt: {problem}; it will not be loaded")
    state = read_state(path)
    updates: dict[str, Tensor] = {}
    for rel, prefix in sources:
        try:
            with safe_open(str(path / rel), framework="pt") as handle:
                keys = [k for k in handle.keys() if prefix or k in shared_wanted]  # noqa: SIM118 (not a dict)
                updates.update({prefix + k: handle.get_tensor(k) for k in keys})
        except Exception as exc:
            raise ValueError(f"checkpoint file {path / rel} is missing or corrupt: {exc}") from exc
    for k, v in updates.items():
        if k not in expected or expected[k].shape != v.shape:
            raise ValueError(
                f"checkpoint {path}: tensor {k!r} {tuple(v.shape)} does not fit the student "
                "(was it written for another student config?)"
            )
    owned_prefixes = tuple(model.block_prefix(i) for i in blocks)
    missing = [
        k for k in expected if (k.startswith(owned_prefixes) or k in shared_wanted) and k not in updates
    ]
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
    if resuming:
        torch.set_rng_state(torch.load(path / rng, weights_only=True)["cpu"])
    return state
