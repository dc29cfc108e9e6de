"""The training loop: learning, accumulation, validation/best, skip, sweeps, resume."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from composer_core.bypass import StudentConfig, build_student, run_bypass, run_sweep
from composer_core.bypass import checkpoint as ckpt
from composer_core.bypass.config import override_from_dict
from composer_core.bypass.data import TokenBatches
from composer_core.bypass.distributed import DistContext
from composer_core.bypass.forward import teacher_forward
from composer_core.bypass.keys import trainable_parameters
from composer_core.bypass.losses import normalized_mse


def _held_out_losses(teacher, student, ids):  # type: ignore[no-untyped-def]
    t_in, t_out, ctx = teacher_forward(teacher, ids, range(teacher.num_blocks), DistContext())
    with torch.no_grad():
        return [normalized_mse(student.run_block(i, t_in[i], ctx), t_out[i]).item() for i in t_in]


def test_pruned_student_block_losses_decrease(S: Any, tmp_path: Path) -> None:
    teacher, ids = S.teacher(), S.tokens(32)
    cfg = S.config(tmp_path, training={"steps": 25, "lr": 1e-2})
    before = _held_out_losses(teacher, build_student(teacher, cfg.student.overrides), ids[-8:])
    result = run_bypass(teacher, ids, cfg, progress=False)
    after = _held_out_losses(teacher, result.student, ids[-8:])
    assert all(b > 0 for b in before)
    assert all(a < 0.8 * b for a, b in zip(after, before, strict=True)), (before, after)
    assert len(result.history) == 25 and result.batches_consumed == 25


def test_identical_student_trains_at_zero_loss(S: Any, tmp_path: Path) -> None:
    teacher = S.teacher()
    result = run_bypass(teacher, S.tokens(), S.config(tmp_path, student={"overrides": []}), progress=False)
    assert all(v == 0.0 for h in result.history for v in h["block_loss"].values())
    for (n, p), (_, q) in zip(result.student.named_parameters(), teacher.named_parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("loss_scaling", [False, True])
def test_grad_accumulation_averages_micro_batches(S: Any, tmp_path: Path, loss_scaling: bool) -> None:
    """Closed form: after one AdamW step exp_avg = (1 − β1)·mean_k ∇L(batch k) (unscaled)."""
    teacher, ids = S.teacher(num_layers=1), S.tokens()
    cfg = S.config(
        tmp_path,
        training={
            "steps": 1,
            "grad_accum": 2,
            "micro_batch_size": 2,
            "clip": "none",
            "warmup_steps": 0,
            "loss_scaling": loss_scaling,
        },
    )
    result = run_bypass(teacher, ids, cfg, progress=False)
    student = build_student(teacher, cfg.student.overrides)
    params = [p for _, p in trainable_parameters(student, 0, ("entire_block",))]
    data = TokenBatches(ids, micro_batch_size=2, seed=0)
    for k in range(2):
        t_in, t_out, ctx = teacher_forward(teacher, data.batch(k), [0], DistContext())
        (normalized_mse(student.run_block(0, t_in[0], ctx), t_out[0]) / 2).backward()
    saved = torch.load(result.experiment_dir / "final" / "optim" / "block-0000.pt", weights_only=True)
    state = saved["optimizer"]["state"]
    assert len(state) == len(params)
    for i, p in enumerate(params):
        torch.testing.assert_close(state[i]["exp_avg"], 0.1 * p.grad, rtol=1e-5, atol=1e-9)
    if loss_scaling:
        assert saved["scaler"]["scale"] > 1


def test_validation_and_best_checkpoint(S: Any, tmp_path: Path) -> None:
    cfg = S.config(tmp_path, training={"steps": 6}, run={"val_every": 2, "val_sequences": 8})
    result = run_bypass(S.teacher(), S.tokens(32), cfg, progress=False)
    assert [v["step"] for v in result.validation] == [2, 4, 6]
    assert all(set(v["block_loss"]) == {"0", "1", "2"} and v["lm_loss"] > 0 for v in result.validation)
    best = min(result.validation, key=lambda v: v["lm_loss"])
    state = ckpt.read_state(result.experiment_dir / "best")
    assert state["best"] == {"step": best["step"], "value": best["lm_loss"]} and state["step"] == best["step"]
    assert ckpt.is_complete(result.experiment_dir / "best")
    assert (result.experiment_dir / "latest").resolve() == (result.experiment_dir / "final").resolve()


def test_skip_if_complete(S: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    teacher, ids = S.teacher(), S.tokens()
    cfg = S.config(tmp_path)
    first = run_bypass(teacher, ids, cfg, progress=False)
    calls: list[int] = []
    original = TokenBatches.batch
    monkeypatch.setattr(TokenBatches, "batch", lambda self, i: calls.append(i) or original(self, i))
    again = run_bypass(teacher, ids, cfg, progress=False)
    assert again.skipped and not first.skipped and calls == []
    assert again.history == first.history and again.experiment_dir == first.experiment_dir
    for (n, p), (_, q) in zip(
        again.student.named_parameters(), first.student.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), n
    with pytest.warns(UserWarning, match="superseded by a run started with resume=False"):
        fresh = run_bypass(teacher, ids, cfg, resume=False, progress=False)
    assert not fresh.skipped and len(calls) == 6
    assert (fresh.experiment_dir / "aside" / "final-0" / "COMPLETE").is_file()


def test_sweep_runs_each_student(S: Any, tmp_path: Path) -> None:
    cfg = S.config(tmp_path, training={"steps": 2})
    students = [StudentConfig(overrides=(override_from_dict({"intermediate_size": n}),)) for n in (8, 16)]
    results = run_sweep(S.teacher(), S.tokens(), cfg, students, progress=False)
    assert len({r.run_id for r in results}) == 2
    assert all(ckpt.is_complete(r.experiment_dir / "final") for r in results)
    assert results[0].student.layers[0].mlp.up_proj.weight.shape[0] == 8
    with pytest.raises(ValueError, match="at least one"):
        run_sweep(S.teacher(), S.tokens(), cfg, [])


class _Crash(Exception):
    pass


def test_resume_continues_at_batches_consumed(
    S: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Puzzletron review: resume used saved_skip + iter − 1 and retrained a batch. Here: explicit counter."""
    teacher, ids = S.teacher(), S.tokens()
    ref = run_bypass(teacher, ids, S.config(tmp_path / "ref", training={"grad_accum": 2}), progress=False)
    cfg = S.config(tmp_path / "run", training={"grad_accum": 2}, run={"save_every": 2})

    def crash(name: str, phase: str) -> None:
        if (name, phase) == ("step-00000004", "rename"):
            raise _Crash

    monkeypatch.setattr(ckpt, "_fault_point", crash)
    with pytest.raises(_Crash):
        run_bypass(teacher, ids, cfg, progress=False)
    monkeypatch.setattr(ckpt, "_fault_point", lambda name, phase: None)
    calls: list[int] = []
    original = TokenBatches.batch
    monkeypatch.setattr(TokenBatches, "batch", lambda self, i: calls.append(i) or original(self, i))
    resumed = run_bypass(teacher, ids, cfg, progress=False)
    assert calls == list(range(8, 12))  # step-4 was complete (renamed) -> 4 steps × 2 micro-batches consumed
    assert resumed.history == ref.history and resumed.batches_consumed == 12
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            S.final_blocks(resumed.experiment_dir).values(),
            S.final_blocks(ref.experiment_dir).values(),
            strict=True,
        )
    )
    state = json.loads((resumed.experiment_dir / "step-00000004" / "state.json").read_text())
    assert (state["step"], state["batches_consumed"]) == (4, 8)


def test_bad_token_data_raises(S: Any, tmp_path: Path) -> None:
    ids = S.tokens()
    ids[3, 2] = S.VOCAB
    with pytest.raises(ValueError, match="token id 48 but the teacher's vocabulary has 48"):
        run_bypass(S.teacher(), ids, S.config(tmp_path), progress=False)
    with pytest.raises(ValueError, match="2-D integer tensor"):
        run_bypass(S.teacher(), S.tokens().float(), S.config(tmp_path), progress=False)
    with pytest.raises(ValueError, match="fewer than micro_batch_size"):
        run_bypass(S.teacher(), S.tokens(n=6), S.config(tmp_path, run={"val_sequences": 3}), progress=False)
