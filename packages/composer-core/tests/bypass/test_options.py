"""Schedule, keys_to_learn, partitioning, run identity, optimiser step (incl. Puzzletron regressions)."""

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from composer_core.bypass import BlockOverride, build_student, canonical_keys, cosine_lr, partition_blocks
from composer_core.bypass.identity import run_identity, sha256_json
from composer_core.bypass.keys import check_keys_for_model, freeze_for_training
from composer_core.bypass.optim import make_block_optimizer, optimizer_step


def test_cosine_lr_values() -> None:
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=14)
    assert [cosine_lr(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine_lr(4, **kw) == pytest.approx(1.0)
    assert cosine_lr(9, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert cosine_lr(14, **kw) == pytest.approx(0.1)
    assert cosine_lr(100, **kw) == pytest.approx(0.1)  # floor
    with pytest.raises(ValueError, match="min_lr"):
        cosine_lr(0, lr=0.1, min_lr=0.2, warmup_steps=0, total_steps=5)


def test_canonical_keys() -> None:
    assert canonical_keys(["subblock_ffn", "subblock_attention", "subblock_ffn"]) == (
        "subblock_attention",
        "subblock_ffn",
    )
    assert canonical_keys("entire_block") == ("entire_block",)
    with pytest.raises(ValueError, match="cannot be mixed"):
        canonical_keys(["entire_block", "subblock_ffn"])
    with pytest.raises(ValueError, match="unknown"):
        canonical_keys(["subblock_moe"])
    with pytest.raises(ValueError, match="empty"):
        canonical_keys([])


def test_keys_order_does_not_change_identity(S: Any, tmp_path: Path) -> None:
    a = S.config(tmp_path, training={"keys_to_learn": ["subblock_ffn", "subblock_attention"]})
    b = S.config(
        tmp_path / "elsewhere",
        training={"keys_to_learn": ["subblock_attention", "subblock_ffn"]},
        run={"save_every": 3},
    )
    c = S.config(tmp_path, training={"keys_to_learn": ["subblock_ffn"]})
    ida, idb, idc = (sha256_json(run_identity(x.identity_fields(), "t", "d")) for x in (a, b, c))
    assert ida == idb  # order, output_dir and save cadence are not part of the identity
    assert ida != idc
    assert ida != sha256_json(
        run_identity(S.config(tmp_path, training={"lr": 1e-4}).identity_fields(), "t", "d")
    )


def test_subblock_mamba_without_mamba_raises(S: Any) -> None:
    """Puzzletron review: subblock_mamba on a model without mamba silently trained attention."""
    model = S.teacher()
    with pytest.raises(ValueError, match="no student block has a mamba subblock"):
        check_keys_for_model(model, ("subblock_mamba",))


def test_keys_select_subblock_parameters(S: Any) -> None:
    model = S.teacher(num_layers=2)
    student = build_student(model, [BlockOverride(blocks=(1,), mixer="mamba")])
    check_keys_for_model(student, ("subblock_mamba",))
    params = freeze_for_training(student, [0, 1], ("subblock_mamba",))
    assert params[0] == []  # block 0 has attention only
    names = {n for n, p in student.named_parameters() if p.requires_grad}
    assert names and all(n.startswith(("layers.1.mamba.", "layers.1.input_layernorm.")) for n in names)
    params = freeze_for_training(student, [0, 1], ("subblock_ffn",))
    names = {n for n, p in student.named_parameters() if p.requires_grad}
    assert names == {
        n for n, _ in student.named_parameters() if ".mlp." in n or "post_attention_layernorm" in n
    }
    assert not any(p.requires_grad for n, p in student.named_parameters() if not n.startswith("layers."))


def test_partition_blocks() -> None:
    assert partition_blocks(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert partition_blocks(4, 4) == [range(i, i + 1) for i in range(4)]
    assert partition_blocks(5, 1) == [range(0, 5)]
    with pytest.raises(ValueError, match="world_size=3 exceeds the number of blocks \\(2\\)"):
        partition_blocks(2, 3)


def _toy(scaling: bool, clip: str, value: float) -> tuple[torch.nn.Parameter, list[torch.Tensor]]:
    p = torch.nn.Parameter(torch.zeros(4))
    block = make_block_optimizer(
        0,
        [p],
        lr=0.1,
        betas=(0.9, 0.99),
        eps=1e-8,
        weight_decay=0.0,
        loss_scaling=scaling,
        init_scale=2.0**10,
    )
    seen: list[torch.Tensor] = []
    block.optimizer.register_step_pre_hook(lambda opt, a, k: seen.append(p.grad.detach().clone()))
    g = torch.tensor([0.3, -0.4, 0.0, 0.0])  # ‖g‖ = 0.5
    block.scaler.scale((p * g).sum()).backward()
    norm = optimizer_step(block, lr=0.1, clip=clip, clip_value=value)  # type: ignore[arg-type]
    assert norm == pytest.approx(0.5)
    assert p.grad is None  # zero_grad(set_to_none=True)
    return p, seen


@pytest.mark.parametrize("scaling", [False, True])
def test_clip_norm_after_unscale(scaling: bool) -> None:
    """Puzzletron review: clipping before GradScaler.unscale_ clips the scaled gradient (×2^10)."""
    _, seen = _toy(scaling, "norm", 1.0)  # 0.5 < 1: untouched
    torch.testing.assert_close(seen[0], torch.tensor([0.3, -0.4, 0.0, 0.0]))
    _, seen = _toy(scaling, "norm", 0.1)  # clipped to norm 0.1, not 0.1 / 2^10
    torch.testing.assert_close(seen[0], torch.tensor([0.06, -0.08, 0.0, 0.0]))


def test_clip_value_after_unscale() -> None:
    _, seen = _toy(True, "value", 0.35)
    torch.testing.assert_close(seen[0], torch.tensor([0.3, -0.35, 0.0, 0.0]))
    _, seen = _toy(True, "none", 1.0)
    torch.testing.assert_close(seen[0], torch.tensor([0.3, -0.4, 0.0, 0.0]))


def test_only_floating_point_parameters_train(S: Any) -> None:
    model = S.teacher(num_layers=1)
    model.layers[0].mlp.register_parameter(
        "codebook", torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    )
    params = freeze_for_training(model, [0], ("entire_block",))
    assert all(p.is_floating_point() for p in params[0])
    assert len(params[0]) == sum(1 for p in model.layers[0].parameters() if p.is_floating_point())
    assert not model.layers[0].mlp.codebook.requires_grad
