"""Bypass checkpoints under faults (issue 15 item 3), with real ``composer-bypass`` processes.

- bit rot: one flipped bit in a checkpoint's tensor data is detected (SHA-256 per file in the
  ``COMPLETE`` marker), the corrupt checkpoint is set aside and the run resumes from the newest
  intact one, bit-exact against an uninterrupted run;
- retention: ``run.keep_last`` / ``--keep-last``;
- disk full / read-only output: one line naming the path and the cause, exit 3. The real
  faults use a private mount namespace (``unshare -rm``: a 64 KiB tmpfs for ENOSPC, a read-only
  bind mount for EROFS; both vanish with the process). Where ``unshare`` is not permitted those
  tests skip, and an in-process test simulates ENOSPC by making safetensors' writer fail.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from composer_core.bypass import checkpoint as ckpt
from composer_core.bypass import config_from_dict, run_bypass
from composer_core.bypass.checkpoint import KILL_ENV

SECTIONS: dict[str, Any] = {
    "student": {"overrides": [{"intermediate_size": 8, "num_key_value_heads": 2}]},
    "training": {"steps": 6, "micro_batch_size": 4, "lr": 3e-3, "warmup_steps": 1},
}


def _toml(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return json.dumps(v)


def write_run(
    root: Path, name: str, run: dict[str, Any], base: dict[str, Any]
) -> tuple[Path, dict[str, Any]]:
    tables = {
        **SECTIONS,
        "run": {"output_dir": str(root / name), **run},
        "teacher": {"kind": "reference", "path": str(base["teacher"])},
        "data": {"path": str(base["tokens"])},
        "output": {"plot": False},
    }
    text = "\n".join(
        f"[{t}]\n" + "\n".join(f"{k} = {_toml(v)}" for k, v in body.items()) for t, body in tables.items()
    )
    path = root / f"{name}.toml"
    path.write_text(text + "\n")
    return path, {k: tables[k] for k in ("student", "training", "run")}


def cli(config: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    argv = [
        sys.executable,
        "-m",
        "composer_core.bypass.cli",
        "--config",
        str(config),
        "--no-progress",
        *flags,
    ]
    proc = subprocess.run(
        argv, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, S: Any) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("bypass-faults")
    teacher = S.teacher(num_layers=2)
    teacher.save(root / "teacher")
    ids = S.tokens(32)
    tokens = S.write_tokens(root / "tokens.safetensors", ids)
    b = {"root": root, "teacher": root / "teacher", "tokens": tokens, "ids": ids}
    _, cfg = write_run(root, "ref", {"save_every": 2}, b)
    b["ref"] = run_bypass(type(teacher).load(root / "teacher"), ids, config_from_dict(cfg), progress=False)
    return b


def flip_bit_in_tensor_data(file: Path) -> int:
    """Flip one bit in the middle of a safetensors file's tensor data (after the JSON header)."""
    raw = bytearray(file.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    pos = start + (len(raw) - start) // 2
    raw[pos] ^= 0x10
    file.write_bytes(bytes(raw))
    return pos


def assert_bit_exact(exp: Path, ref: Any, S: Any) -> None:
    got, want = S.final_blocks(exp), S.final_blocks(ref.experiment_dir)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((exp / "history.json").read_text())["history"] == ref.history


def test_bit_flip_is_detected_on_load(S: Any, base: dict[str, Any]) -> None:
    _, cfg = write_run(base["root"], "ref", {"save_every": 2}, base)
    step4 = base["ref"].experiment_dir / "step-00000004"
    copy = base["root"] / "flip" / "step-00000004"
    shutil.copytree(step4, copy)
    flip_bit_in_tensor_data(copy / "blocks" / "block-0001.safetensors")
    from composer_core.bypass.data import TokenBatches
    from composer_core.bypass.distributed import DistContext
    from composer_core.bypass.train import make_student

    teacher = type(S.teacher()).load(base["teacher"])
    config = config_from_dict(cfg)
    data = TokenBatches(base["ids"], micro_batch_size=4, seed=0, val_sequences=0)
    model = make_student(teacher, config.student, data)
    with pytest.raises(ValueError, match=r"block-0001\.safetensors fails its SHA-256 check"):
        ckpt.load_checkpoint(copy, model=model, blocks=[0, 1], optimizers=None, ctx=DistContext())
    ckpt.load_checkpoint(step4, model=model, blocks=[0, 1], optimizers=None, ctx=DistContext())  # intact


@pytest.mark.parametrize("corrupt", ["blocks/block-0001.safetensors", "state.json", "two newest"])
def test_corrupt_newest_checkpoint_is_set_aside_and_run_resumes_bit_exact(
    S: Any, base: dict[str, Any], corrupt: str
) -> None:
    """SIGKILL during the final save (step-2 and step-4 complete), corrupt step-4, re-run the CLI:
    step-4 goes to aside/step-00000004.corrupt-<time>-0, the run resumes from step-2 and ends
    bit-identical to the uninterrupted run."""
    name = "corrupt-" + corrupt.replace("/", "_").replace(" ", "_")
    toml, _ = write_run(base["root"], name, {"save_every": 2}, base)
    rc, _, err = cli(toml, env={KILL_ENV: "final:optimizer"})
    assert rc == -signal.SIGKILL, err
    (exp,) = (base["root"] / name).iterdir()
    assert ckpt.is_complete(exp / "step-00000004") and ckpt.is_complete(exp / "step-00000002")
    if corrupt == "state.json":
        (exp / "step-00000004" / "state.json").write_text('{"step": 4, "batches_consu')
    elif corrupt == "two newest":  # nothing intact: the run starts over (and still ends bit-exact)
        for step in ("step-00000004", "step-00000002"):
            flip_bit_in_tensor_data(exp / step / "blocks" / "block-0000.safetensors")
    else:
        flip_bit_in_tensor_data(exp / "step-00000004" / corrupt)
    rc, _, err = cli(toml)
    assert rc == 0, err
    aside = sorted(p.name for p in (exp / "aside").iterdir())
    corrupt_dirs = [a for a in aside if ".corrupt-" in a]
    assert [a.split(".corrupt-")[0] for a in corrupt_dirs] == (
        ["step-00000002", "step-00000004"] if corrupt == "two newest" else ["step-00000004"]
    )
    assert "corrupt:" in err and ("SHA-256" in err or "state.json" in err)
    assert_bit_exact(exp, base["ref"], S)


def test_corrupt_final_of_a_completed_run_is_retrained_from_newest_intact(
    S: Any, base: dict[str, Any]
) -> None:
    toml, _ = write_run(base["root"], "final-rot", {"save_every": 2}, base)
    rc, _, err = cli(toml)
    assert rc == 0, err
    (exp,) = (base["root"] / "final-rot").iterdir()
    flip_bit_in_tensor_data(exp / "final" / "blocks" / "block-0000.safetensors")
    rc, out, err = cli(toml)
    assert rc == 0 and "(trained)" in out and "skipped" not in out, err
    assert [p.name.split(".corrupt-")[0] for p in (exp / "aside").iterdir()] == ["final"]
    assert_bit_exact(exp, base["ref"], S)


# --- retention ----------------------------------------------------------------------------------


def test_keep_last_config_and_cli(S: Any, base: dict[str, Any]) -> None:
    root = base["root"]
    run = {"save_every": 1, "val_every": 2, "val_sequences": 4}
    _, cfg = write_run(root, "keep2", {**run, "keep_last": 2}, base)
    teacher = type(S.teacher()).load(base["teacher"])
    res = run_bypass(teacher, base["ids"], config_from_dict(cfg), progress=False)
    names = sorted(p.name for p in res.experiment_dir.iterdir() if p.is_dir() and not p.is_symlink())
    assert names == ["best", "final", "step-00000004", "step-00000005"]
    _, all_cfg = write_run(root, "keepall", run, base)
    every = run_bypass(teacher, base["ids"], config_from_dict(all_cfg), progress=False)
    assert len([p for p in every.experiment_dir.iterdir() if p.name.startswith("step-")]) == 5
    assert res.run_id == every.run_id  # retention is not part of the run identity
    got, want = S.final_blocks(res.experiment_dir), S.final_blocks(every.experiment_dir)
    assert all(torch.equal(got[k], want[k]) for k in want)

    toml, _ = write_run(root, "keep1", {**run, "keep_last": 3}, base)
    rc, _, err = cli(toml, "--keep-last", "1")  # the flag overrides run.keep_last
    assert rc == 0, err
    (exp,) = (root / "keep1").iterdir()
    kept = sorted(p.name for p in exp.iterdir() if p.is_dir() and not p.is_symlink())
    assert kept == ["best", "final", "step-00000005", "student"]
    rc, _, err = cli(toml, "--keep-last", "-1")
    assert rc == 2 and "--keep-last must be >= 0" in err
    with pytest.raises(ValueError, match=r"run\.keep_last must be >= 0"):
        config_from_dict({"run": {"keep_last": -2}})
    with pytest.raises(ValueError, match=r"run\.keep_last must be an integer"):
        config_from_dict({"run": {"keep_last": "3"}})


def test_interrupted_prune_never_looks_like_a_checkpoint(tmp_path: Path, base: dict[str, Any]) -> None:
    src = base["ref"].experiment_dir
    for name in ("step-00000002", "step-00000004"):
        shutil.copytree(src / name, tmp_path / name)
    (tmp_path / "step-00000004").rename(tmp_path / "step-00000004.deleting")  # killed mid-delete
    assert ckpt.find_resume_checkpoint(tmp_path) == tmp_path / "step-00000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]
    assert ckpt.prune_checkpoints(tmp_path, 1) == [] and ckpt.prune_checkpoints(tmp_path, 0) == []


# --- disk full and read-only output -------------------------------------------------------------


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


needs_mount_ns = pytest.mark.skipif(
    not _unshare_works(), reason="unshare -rm (private mount namespace) not permitted"
)


@needs_mount_ns
def test_disk_full_is_one_line_and_exit_3(base: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "full"
    out.mkdir()
    toml, _ = write_run(tmp_path, "full", {"save_every": 1}, base)
    wrap = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=64k tmpfs \'{out}\' && exec "$0" "$@"']
    rc, _, err = cli_in(wrap, toml)
    assert rc == 3, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert (
        last.startswith(f"composer-bypass: error: cannot write {out}/")
        and "No space left on device (ENOSPC)" in last
    )


@needs_mount_ns
def test_read_only_output(base: dict[str, Any], tmp_path: Path) -> None:
    toml, _ = write_run(tmp_path, "ro", {"save_every": 2}, base)
    rc, out, err = cli(toml)
    assert rc == 0, err
    out_dir = tmp_path / "ro"
    before = {p: p.stat().st_mtime_ns for p in out_dir.rglob("*")}
    wrap = ["unshare", "-rm", "sh", "-c", f"mount --bind -o ro '{out_dir}' '{out_dir}' && exec \"$0\" \"$@\""]
    rc, out, err = cli_in(wrap, toml)  # the completed run, re-run on a read-only disk
    assert rc == 0 and "skipped: already complete" in out, err
    assert {p: p.stat().st_mtime_ns for p in out_dir.rglob("*")} == before
    other, _ = write_run(tmp_path, "ro", {"save_every": 3}, base)  # same output dir...
    other.write_text(other.read_text().replace("steps = 6", "steps = 5"))  # ...a new run: must write
    rc, _, err = cli_in(wrap, other)
    assert rc == 3 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"composer-bypass: error: cannot write {out_dir}/") and "(EROFS)" in last


def cli_in(wrap: list[str], config: Path) -> tuple[int, str, str]:
    argv = [*wrap, sys.executable, "-m", "composer_core.bypass.cli", "--config", str(config), "--no-progress"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_write_error_in_process_is_one_line(
    base: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Simulated (runs without mount rights): the open() of the first checkpoint file fails with ENOSPC."""
    import builtins
    import errno

    from composer_core.bypass.cli import main

    real_open = builtins.open

    def full(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode and ".partial" in str(file):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full)
    toml, _ = write_run(tmp_path, "sim", {"save_every": 2}, base)
    assert main(["--config", str(toml), "--no-progress"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert (
        err.startswith(f"composer-bypass: error: cannot write {tmp_path / 'sim'}/")
        and "step-00000002.partial/" in err
    )
    assert "No space left on device (ENOSPC)" in err
