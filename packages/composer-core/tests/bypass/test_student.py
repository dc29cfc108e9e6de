"""Student construction and initialisation from the teacher."""

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from composer_core.bypass import BlockOverride, build_student, init_from_teacher, resolve_block_configs
from composer_core.bypass.distributed import DistContext
from composer_core.bypass.forward import teacher_forward
from composer_core.bypass.losses import normalized_mse
from composer_core.bypass.student import ffn_channel_importance
from torch import nn


def _block_losses(teacher, student, ids):  # type: ignore[no-untyped-def]
    t_in, t_out, ctx = teacher_forward(teacher, ids, range(teacher.num_blocks), DistContext())
    with torch.no_grad():
        return [normalized_mse(student.run_block(i, t_in[i], ctx), t_out[i]).item() for i in t_in]


def test_identical_student_has_zero_block_loss(S: Any) -> None:
    t = S.teacher()
    s = build_student(t, [])
    assert _block_losses(t, s, S.tokens(4)) == [0.0, 0.0, 0.0]


def test_block_count_mismatch_raises(S: Any) -> None:
    t = S.teacher(num_layers=3)
    with pytest.raises(ValueError, match="student has 2 blocks but the teacher has 3"):
        resolve_block_configs(t.block_configs(), [], num_blocks=2)
    with pytest.raises(ValueError, match="student has 2 blocks but the teacher has 3"):
        init_from_teacher(S.teacher(num_layers=2), t)
    with pytest.raises(ValueError, match="names block 5"):
        build_student(t, [BlockOverride(blocks=(5,), ffn_no_op=True)])


def test_ffn_truncation_copies_leading_channels(S: Any) -> None:
    t = S.teacher()
    s = build_student(t, [BlockOverride(blocks=(1,), intermediate_size=8)])
    tm, sm = t.layers[1].mlp, s.layers[1].mlp
    torch.testing.assert_close(sm.gate_proj.weight, tm.gate_proj.weight[:8], rtol=0, atol=0)
    torch.testing.assert_close(sm.up_proj.weight, tm.up_proj.weight[:8], rtol=0, atol=0)
    torch.testing.assert_close(sm.down_proj.weight, tm.down_proj.weight[:, :8], rtol=0, atol=0)
    torch.testing.assert_close(
        s.layers[0].mlp.gate_proj.weight, t.layers[0].mlp.gate_proj.weight, rtol=0, atol=0
    )


def test_importance_pruning_keeps_the_strongest_channels(S: Any) -> None:
    t = S.teacher(num_layers=1)
    with torch.no_grad():  # make channels 3, 17, 29 dominate block 0's FFN activations
        for c in (3, 17, 29):
            t.layers[0].mlp.up_proj.weight[c] *= 50
    ids = [S.tokens(4, seed=s) for s in range(2)]
    scores = ffn_channel_importance(t, ids)
    # closed form: sqrt(mean a²) of the down_proj input on the same batches
    acts = []
    for b in ids:
        h, ctx = t.prepare(b)
        x = t.layers[0].post_attention_layernorm(
            h + t.layers[0].self_attn(t.layers[0].input_layernorm(h), ctx["rot"])
        )
        m = t.layers[0].mlp
        acts.append((torch.nn.functional.silu(m.gate_proj(x)) * m.up_proj(x)).reshape(-1, 32))
    torch.testing.assert_close(scores[0], torch.cat(acts).pow(2).mean(0).sqrt())
    s = build_student(t, [BlockOverride(intermediate_size=3)], mlp_init_mode="importance", calibration=ids)
    torch.testing.assert_close(s.layers[0].mlp.up_proj.weight, t.layers[0].mlp.up_proj.weight[[3, 17, 29]])
    trunc = build_student(t, [BlockOverride(intermediate_size=3)])
    importance_loss = _block_losses(t, s, ids[0])[0]
    assert importance_loss < _block_losses(t, trunc, ids[0])[0]
    with pytest.raises(ValueError, match="calibration"):
        build_student(t, [BlockOverride(intermediate_size=3)], mlp_init_mode="importance")


def test_kv_heads_averaged(S: Any) -> None:
    t = S.teacher(num_layers=1)
    s = build_student(t, [BlockOverride(num_key_value_heads=2)])
    d = 4  # head_dim
    for proj in ("k_proj", "v_proj"):
        tw = getattr(t.layers[0].self_attn, proj).weight
        sw = getattr(s.layers[0].self_attn, proj).weight
        assert sw.shape == (2 * d, 16)
        torch.testing.assert_close(sw[:d], (tw[:d] + tw[d : 2 * d]) / 2)
        torch.testing.assert_close(sw[d:], (tw[2 * d : 3 * d] + tw[3 * d :]) / 2)
    first = build_student(t, [BlockOverride(num_key_value_heads=2)], gqa_init_mode="first")
    torch.testing.assert_close(
        first.layers[0].self_attn.k_proj.weight[d:], t.layers[0].self_attn.k_proj.weight[2 * d : 3 * d]
    )


def test_kv_average_is_exact_when_grouped_heads_agree(S: Any) -> None:
    t = S.teacher(num_layers=1)
    with torch.no_grad():  # teacher heads (0,1) and (2,3) identical: 2 averaged heads reproduce it
        for proj in (t.layers[0].self_attn.k_proj, t.layers[0].self_attn.v_proj):
            proj.weight[4:8] = proj.weight[0:4]
            proj.weight[12:16] = proj.weight[8:12]
    s = build_student(t, [BlockOverride(num_key_value_heads=2)])
    assert _block_losses(t, s, S.tokens(4))[0] == pytest.approx(0.0, abs=1e-12)


def test_no_op_subblocks(S: Any) -> None:
    t = S.teacher(num_layers=2)
    s = build_student(
        t, [BlockOverride(blocks=(0,), attention_no_op=True), BlockOverride(blocks=(1,), ffn_no_op=True)]
    )
    assert s.layers[0].self_attn is None and s.layers[0].input_layernorm is None
    assert s.layers[1].mlp is None and set(s.subblocks(1)) == {"attention"}
    h = torch.randn(2, 5, 16)
    _, ctx = t.prepare(torch.zeros(2, 5, dtype=torch.long))
    l0 = t.layers[0]
    torch.testing.assert_close(s.run_block(0, h, ctx), h + l0.mlp(l0.post_attention_layernorm(h)))
    l1 = t.layers[1]
    expected = h + l1.self_attn(l1.input_layernorm(h), ctx["rot"])
    torch.testing.assert_close(s.run_block(1, h, ctx), expected)
    both = build_student(t, [BlockOverride(blocks=(1,), ffn_no_op=True, attention_no_op=True)])
    assert list(both.layers[1].parameters()) == []
    torch.testing.assert_close(both.run_block(1, h, ctx), h)


def test_shrink_beyond_teacher_raises(S: Any) -> None:
    with pytest.raises(ValueError, match="exceeds the teacher"):
        build_student(S.teacher(), [BlockOverride(intermediate_size=64)])
    with pytest.raises(ValueError, match="must divide"):
        build_student(S.teacher(), [BlockOverride(num_key_value_heads=3)])


def test_reference_save_load_roundtrip(S: Any, tmp_path: Path) -> None:
    s = build_student(S.teacher(), [BlockOverride(blocks=(2,), intermediate_size=8, attention_no_op=True)])
    s.save(tmp_path)
    loaded = type(s).load(tmp_path)
    ids = S.tokens(2)
    torch.testing.assert_close(loaded(ids), s(ids), rtol=0, atol=0)
    with pytest.raises(ValueError, match="not a reference decoder directory"):
        type(s).load(tmp_path / "missing")


def test_sharded_skeleton_imports_no_compiler_stack(S: Any, tmp_path: Path) -> None:
    """Building a rank's skeleton runs no initialiser on ``meta`` tensors: ``normal_`` on meta has no
    C++ kernel and pulls in torch._dynamo (~800 modules, seconds per rank). (torch.distributed.nn, 9 modules,
    is imported on purpose with the engine: see ``test_destroy_process_group_ends_its_threads_...``.)"""
    S.teacher(num_layers=3).save(tmp_path / "teacher")
    code = (
        "import sys\n"
        "from composer_core.bypass.distributed import Ownership\n"
        "from composer_core.bypass.reference import ReferenceDecoder\n"
        f"m = ReferenceDecoder.load({str(tmp_path / 'teacher')!r}, Ownership.of(3, 1, 2), head=False)\n"
        "print(sorted(k for k in ('torch._dynamo',) if k in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_embedding_initialisation_is_unchanged(S: Any) -> None:
    """The embedding is created as before (same RNG draws): ``nn.Embedding``'s own N(0, 1) init."""
    teacher = S.teacher(num_layers=1)
    cfg = teacher.config
    torch.manual_seed(3)
    model = type(teacher)(cfg)
    torch.manual_seed(3)
    want = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    assert torch.equal(model.embed_tokens.weight, want.weight)
