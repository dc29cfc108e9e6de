"""Checkpoint layout, re-save, partial/corrupt checkpoints and the run manifest."""

from pathlib import Path
from typing import Any

import pytest
import torch
from composer_core.bypass import checkpoint as ckpt
from composer_core.bypass import run_bypass
from composer_core.bypass.distributed import DistContext
from composer_core.bypass.keys import freeze_for_training
from composer_core.bypass.optim import make_block_optimizer, optimizer_step


def _setup(S: Any):  # type: ignore[no-untyped-def]
    model = S.teacher(num_layers=2)
    params = freeze_for_training(model, [0, 1], ("entire_block",))
    opts = {
        i: make_block_optimizer(
            i, ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, loss_scaling=False, init_scale=1.0
        )
        for i, ps in params.items()
    }
    return model, opts


def _step(S: Any, model, opts) -> None:  # type: ignore[no-untyped-def]
    out = model(S.tokens(2))
    out.pow(2).mean().backward()
    for o in opts.values():
        optimizer_step(o, lr=1e-2, clip="none", clip_value=1.0)


def _save(exp: Path, name: str, model, opts, step: int) -> Path:  # type: ignore[no-untyped-def]
    return ckpt.save_checkpoint(
        exp,
        name,
        model=model,
        blocks=[0, 1],
        optimizers=opts,
        state={"step": step, "batches_consumed": step},
        ctx=DistContext(),
    )


def test_resave_overwrites_optimizer_state(S: Any, tmp_path: Path) -> None:
    """Puzzletron review: a re-save passed the cleanup flag as overwrite= and kept stale optimizer state."""
    model, opts = _setup(S)
    _step(S, model, opts)
    path = _save(tmp_path, "best", model, opts, 1)
    (path / "optim" / "block-0007.pt").write_bytes(b"stale")
    _step(S, model, opts)
    _save(tmp_path, "best", model, opts, 2)
    saved = torch.load(path / "optim" / "block-0000.pt", weights_only=True)["optimizer"]
    current = opts[0].optimizer.state_dict()
    assert float(saved["state"][0]["step"]) == 2.0
    assert all(
        torch.equal(saved["state"][k]["exp_avg"], current["state"][k]["exp_avg"]) for k in current["state"]
    )
    assert not (path / "optim" / "block-0007.pt").exists()
    assert ckpt.read_state(path)["step"] == 2 and not (tmp_path / "best.old").exists()


def test_layout_marker_and_latest(S: Any, tmp_path: Path) -> None:
    model, opts = _setup(S)
    path = _save(tmp_path, ckpt.step_name(3), model, opts, 3)
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE",
        "blocks",
        "optim",
        "rng",
        "shared.safetensors",
        "state.json",
    ]
    assert sorted(p.name for p in (path / "blocks").iterdir()) == [
        "block-0000.safetensors",
        "block-0001.safetensors",
    ]
    assert (tmp_path / "latest").is_symlink() and (tmp_path / "latest").resolve() == path.resolve()
    _save(tmp_path, ckpt.step_name(5), model, opts, 5)
    assert (tmp_path / "latest").readlink() == Path("step-00000005")
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]


def test_unmarked_and_partial_checkpoints_are_set_aside(S: Any, tmp_path: Path) -> None:
    model, opts = _setup(S)
    good = _save(tmp_path, ckpt.step_name(2), model, opts, 2)
    newer = _save(tmp_path, ckpt.step_name(4), model, opts, 4)
    (newer / ckpt.MARKER).unlink()  # e.g. killed before the marker
    (tmp_path / "final.partial").mkdir()
    with pytest.warns(UserWarning) as caught:
        found = ckpt.find_resume_checkpoint(tmp_path)
    messages = " | ".join(str(w.message) for w in caught)
    assert (
        "step-00000004: missing its COMPLETE marker" in messages
        and "final.partial: an interrupted save" in messages
    )
    assert found == good
    assert (tmp_path / "aside" / "step-00000004-0").is_dir() and (
        tmp_path / "aside" / "final.partial-0"
    ).is_dir()
    with pytest.raises(ValueError, match="no COMPLETE marker"):
        ckpt.load_checkpoint(
            tmp_path / "aside" / "step-00000004-0",
            model=model,
            blocks=[0],
            optimizers=None,
            ctx=DistContext(),
        )


def test_best_is_never_resumed_from(S: Any, tmp_path: Path) -> None:
    model, opts = _setup(S)
    _save(tmp_path, "best", model, opts, 9)
    step = _save(tmp_path, ckpt.step_name(2), model, opts, 2)
    assert ckpt.find_resume_checkpoint(tmp_path) == step


def test_corrupt_checkpoint_raises_clearly(S: Any, tmp_path: Path) -> None:
    model, opts = _setup(S)
    path = _save(tmp_path, ckpt.step_name(1), model, opts, 1)
    (path / "blocks" / "block-0001.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"block-0001\.safetensors is missing or corrupt"):
        ckpt.load_checkpoint(path, model=model, blocks=[0, 1], optimizers=opts, ctx=DistContext())
    (path / "state.json").write_text("{")
    with pytest.raises(ValueError, match=r"unreadable state\.json"):
        ckpt.read_state(path)
    other = S.teacher(num_layers=2, intermediate_size=16)
    path2 = _save(tmp_path, ckpt.step_name(2), model, opts, 2)
    with pytest.raises(ValueError, match="does not fit the student"):
        ckpt.load_checkpoint(path2, model=other, blocks=[0], optimizers=None, ctx=DistContext())


def test_experiment_dir_of_another_run_is_refused(S: Any, tmp_path: Path) -> None:
    teacher, ids = S.teacher(), S.tokens()
    cfg = S.config(tmp_path, training={"steps": 1})
    result = run_bypass(teacher, ids, cfg, progress=False)
    manifest = result.experiment_dir / ckpt.MANIFEST
    manifest.write_text(manifest.read_text().replace(result.run_id, "0" * 64))
    with pytest.raises(ValueError, match="belongs to run"):
        run_bypass(teacher, ids, cfg, progress=False)
