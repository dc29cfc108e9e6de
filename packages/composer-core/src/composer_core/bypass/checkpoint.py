"""Crash-safe checkpoints: ``step-N/``, ``best/``, ``final/`` and a ``latest`` link.

A checkpoint is written into ``<name>.partial/``: each rank writes its own blocks'
optimizer+scaler state (``optim/block-i.pt``) and weights (``blocks/block-i.safetensors``)
and its RNG state; rank 0 writes the non-block weights (``shared.safetensors``) and
``state.json`` (step, explicit ``batches_consumed``, history). The completion marker
``COMPLETE`` is written last, then the directory is renamed into place (an older one of the
same name is moved out first, so a re-save never keeps stale optimizer state), then
``latest`` is repointed atomically (temporary symlink + ``os.replace``).

The marker holds the SHA-256 of every other file of the checkpoint. On resume only marked
``step-*``/``final`` directories count; unmarked, ``.partial`` and ``.old`` ones are moved to
``aside/`` with a warning. Candidates are tried newest first and verified against the marker's
checksums: a corrupt one (bit rot, a truncated or missing file, an unreadable ``state.json``) is
moved to ``aside/<name>.corrupt-<UTC time>`` with a warning and the next older one is tried.
``load_checkpoint`` verifies the files it reads, so a corrupt file is never loaded. ``best`` is
never resumed from. ``prune_checkpoints`` keeps the newest K ``step-*`` (``best``/``final``
always kept). A file that cannot be written (disk full, read-only, permissions) raises
:class:`OutputWriteError` (an ``OSError`` naming the path and the cause).
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
from safetensors.torch import load_file
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


def safetensors_write_error(exc: Exception, path: Path) -> OutputWriteError | None:
    """The :class:`OutputWriteError` behind a safetensors I/O error ("... (os error 28) ..."), else None."""
    m = re.search(r"(?:\(os error |IoError\(Os \{ code: )(\d+)", str(exc))
    return None if m is None else OutputWriteError(int(m.group(1)), os.strerror(int(m.group(1))), str(path))


def _write_file(path: Path, data: bytes | memoryview) -> str:
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
    # serialised in memory first: torch.save reports a full disk as a RuntimeError without errno
    buf = io.BytesIO()
    torch.save(obj, buf)
    return _write_file(path, buf.getbuffer())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def shared_state(model: BlockwiseModel, rank: int = 0, world_size: int = 1) -> dict[str, Tensor]:
    """The non-block tensors rank ``rank`` writes: those it owns (embedding: first rank, rest: last)."""
    prefixes = tuple(model.block_prefix(i) for i in range(model.num_blocks))
    return {
        k: v
        for k, v in model.module.state_dict().items()
        if not k.startswith(prefixes) and not v.is_meta and name_owner(model, k, world_size) == rank
    }


def shared_file(rank: int) -> str:
    """The non-block tensors' file of ``rank`` (rank 0 keeps the single-writer name)."""
    return "shared.safetensors" if rank == 0 else f"shared-rank-{rank:04d}.safetensors"


def _save_tensors(tensors: Mapping[str, Tensor], path: Path) -> str:
    # clone: tied weights share storage, which safetensors refuses to write twice
    # (serialised in memory, written by _write_file: safetensors' own writer reports a full
    # disk as a SafetensorError without errno or path)
    return _write_file(
        path, safetensors_bytes({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()})
    )


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_marker(path: Path, files: Mapping[str, str]) -> None:
    """The completion marker: the SHA-256 of every other file of the checkpoint (written last).

    ``files`` are the checksums every rank computed of the bytes it wrote (and fsynced) before
    the barrier that precedes the marker; the marker lists exactly the files on disk.
    """
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != MARKER}
    if on_disk != set(files):
        raise ValueError(
            f"checkpoint {path}: files on disk {sorted(on_disk ^ set(files))} were not reported by a rank"
        )
    with open(path / MARKER, "w") as f:
        json.dump({"format": MARKER_FORMAT, "sha256": dict(files)}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def marker_checksums(path: Path) -> dict[str, str] | None:
    """``{relative file: sha256}`` from the marker; None for a legacy marker without checksums."""
    text = (path / MARKER).read_text()
    if text.strip() == "complete":
        return None
    try:
        data = json.loads(text)
        files = data["sha256"]
        if not isinstance(files, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"checkpoint {path}: unreadable {MARKER} marker") from exc
    return {str(k): str(v) for k, v in files.items()}


def verify_files(path: Path, files: Sequence[str] | None = None) -> str | None:
    """None when ``files`` (default: all listed in the marker) match their checksums, else the problem."""
    try:
        sums = marker_checksums(path)
    except (OSError, ValueError) as exc:
        return str(exc)
    if sums is None:
        return None  # written before checksums existed: nothing to verify against
    for rel in files if files is not None else sorted(sums):
        if rel not in sums:
            return f"{rel} is not listed in {MARKER}"
        try:
            got = file_sha256(path / rel)
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
    try:
        return _save_checkpoint(exp_dir, name, model, blocks, optimizers, state, ctx, update_latest)
    except OutputWriteError:
        raise
    except OSError as exc:
        raise _write_error(exc, exp_dir / f"{name}.partial") from exc


def _save_checkpoint(
    exp_dir: Path,
    name: str,
    model: BlockwiseModel,
    blocks: Sequence[int],
    optimizers: Mapping[int, BlockOptimizer],
    state: Mapping[str, Any],
    ctx: DistContext,
    update_latest: bool,
) -> Path:
    final = exp_dir / name
    partial = exp_dir / f"{name}.partial"
    if ctx.is_main:
        if partial.exists():
            shutil.rmtree(partial)
        for sub in ("blocks", "optim", "rng"):
            (partial / sub).mkdir(parents=True)
    ctx.barrier()
    sums = _write_rank_files(partial, name, model, blocks, optimizers, ctx)
    everyone = ctx.gather(sums)  # every rank's files are durable past this point
    if ctx.is_main:
        files = {k: v for part in everyone for k, v in part.items()}
        write_json_atomic(partial / STATE, dict(state))
        files[STATE] = file_sha256(partial / STATE)
        _fault_point(name, "state")
        _write_marker(partial, files)
        _fault_point(name, "marker")
        _publish(exp_dir, name, partial, update_latest)
    ctx.barrier()
    return final


def _write_rank_files(
    partial: Path,
    name: str,
    model: BlockwiseModel,
    blocks: Sequence[int],
    optimizers: Mapping[int, BlockOptimizer],
    ctx: DistContext,
) -> dict[str, str]:
    """This rank's files of the checkpoint (optimizer states, block weights, shared weights, RNG), fsynced;
    their checksums by relative path."""
    sums: dict[str, str] = {}
    for i in blocks:
        if i in optimizers:
            rel = f"optim/block-{i:04d}.pt"
            sums[rel] = _torch_save(optimizers[i].state_dict(), partial / rel)
    _fault_point(name, "optimizer")
    for i in blocks:
        rel = f"blocks/block-{i:04d}.safetensors"
        sums[rel] = _save_tensors(block_state(model, i), partial / rel)
    _fault_point(name, "blocks")
    shared = shared_state(model, ctx.rank, ctx.world_size)
    if shared or ctx.is_main:
        sums[shared_file(ctx.rank)] = _save_tensors(shared, partial / shared_file(ctx.rank))
    rel = f"rng/rank-{ctx.rank:04d}.pt"
    sums[rel] = _torch_save({"cpu": torch.get_rng_state()}, partial / rel)
    for sub in ("blocks", "optim", "rng", "."):
        _fsync_dir(partial / sub)
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


def _check_fits(file: Path, key: str, full: str, v: Tensor, expected: Mapping[str, Tensor]) -> None:
    if full not in expected or expected[full].shape != v.shape:
        raise ValueError(
            f"checkpoint {file}: tensor {key!r} {tuple(v.shape)} does not fit the student "
            "(was it written for another student config?)"
        )


def _shared_files(path: Path, wanted: set[str]) -> dict[str, str]:
    """``{tensor: file}`` for the non-block tensors ``wanted``, from whichever rank's file holds them
    (only the safetensors headers are read)."""
    out: dict[str, str] = {}
    for f in sorted(path.glob("shared*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as handle:
                out.update({k: f.name for k in handle.keys() if k in wanted})  # noqa: SIM118
        except Exception as exc:
            raise ValueError(f"checkpoint file {f} is corrupt: {exc}") from exc
    return out


def _read_tensors(
    path: Path,
    model: BlockwiseModel,
    blocks: Sequence[int],
    shared_files: Mapping[str, str],
    expected: Mapping[str, Tensor],
) -> dict[str, Tensor]:
    """This rank's block tensors and the shared tensors it loads, each checked against the model's."""
    updates: dict[str, Tensor] = {}
    for i in blocks:
        file = path / "blocks" / f"block-{i:04d}.safetensors"
        prefix = model.block_prefix(i)
        try:
            tensors = load_file(str(file))
        except Exception as exc:
            raise ValueError(f"checkpoint file {file} is missing or corrupt: {exc}") from exc
        for k, v in tensors.items():
            _check_fits(file, k, prefix + k, v, expected)
            updates[prefix + k] = v
    for k, rel in shared_files.items():
        with safe_open(str(path / rel), framework="pt") as handle:
            v = handle.get_tensor(k)
        _check_fits(path / rel, k, k, v, expected)
        updates[k] = v
    return updates


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
    expected = {k: v for k, v in model.module.state_dict().items() if not v.is_meta}
    block_prefixes = tuple(model.block_prefix(i) for i in range(model.num_blocks))
    shared_wanted = {k for k in expected if not k.startswith(block_prefixes)} if load_shared else set()
    shared_files = _shared_files(path, shared_wanted)
    mine = [
        STATE,
        *(f"blocks/block-{i:04d}.safetensors" for i in blocks),
        *sorted(set(shared_files.values())),
    ]
    mine += [f"optim/block-{i:04d}.pt" for i in (optimizers or {})]
    rng_rel = f"rng/rank-{ctx.rank:04d}.pt"
    if optimizers is not None and (path / rng_rel).is_file():
        mine.append(rng_rel)
    problem = verify_files(path, mine)
    if problem is not None:
        raise ValueError(f"checkpoint {path} is corrupt: {problem}; it will not be loaded")
    state = read_state(path)
    updates = _read_tensors(path, model, blocks, shared_files, expected)
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
    rng = path / "rng" / f"rank-{ctx.rank:04d}.pt"
    if optimizers is not None and rng.is_file():  # only when resuming training
        torch.set_rng_state(torch.load(rng, weights_only=True)["cpu"])
    return state
