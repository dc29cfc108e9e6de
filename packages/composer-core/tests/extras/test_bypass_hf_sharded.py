"""Issue 20: a student trained and exported by 2 / 4 gloo ranks loads with plain ``from_pretrained``.

Real processes (``composer_core.bypass.cli`` under the torchrun environment variables) train a tiny
Qwen2 student (``composer_core.tasks.tiny``) from a Qwen2 teacher; every rank writes its own shard of the
export and rank 0 the index. ``transformers.AutoModelForCausalLM.from_pretrained(<dir>)`` (local,
``trust_remote_code`` off) must give exactly the tensors the ranks wrote to the ``final/`` checkpoint and
the logits of the engine's blockwise student forward, bit for bit. The same comparison on a copy of the
export whose index lacks the last rank's entries must fail (the test can fail).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from composer_core.bypass import BlockOverride, Ownership, build_student
from composer_core.bypass.checkpoint import load_checkpoint
from composer_core.bypass.data import synthetic_tokens
from composer_core.bypass.distributed import DistContext
from composer_core.bypass.hf import load_hf_model
from composer_core.tasks.tiny import TinyModelConfig, build_tiny_qwen2
from safetensors import safe_open
from safetensors.torch import load_file, save_file

VOCAB, LAYERS = 40, 4
STUDENT = {"intermediate_size": 48, "num_key_value_heads": 1}  # uniform: plain from_pretrained can load it
RUN = """
[teacher]
kind = "hf"
path = "{teacher}"
[data]
path = "{tokens}"
[student]
overrides = [{{intermediate_size = 48, num_key_value_heads = 1}}]
[training]
steps = 4
micro_batch_size = 4
grad_accum = 2
lr = 3e-3
warmup_steps = 1
[run]
output_dir = "{out}"
save_every = 2
[output]
plot = false
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(config: Path, world: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "composer_core.bypass.cli", "--config", str(config), "--no-progress"],
            env={**env, "WORLD_SIZE": str(world), "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        results.append((p.returncode, out, err))
    assert all(rc == 0 for rc, _, _ in results), [err[-2000:] for _, _, err in results]


def _trained_tensors(final: Path) -> dict[str, torch.Tensor]:
    """What the ranks wrote to ``final/``: ``blocks/block-i`` (each by its owner) and ``shared*`` files."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted((final / "blocks").glob("block-*.safetensors")):
        i = int(f.stem.split("-")[1])
        out.update({f"model.layers.{i}.{k}": v for k, v in load_file(str(f)).items()})
    for f in sorted(final.glob("shared*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _mismatches(model: Any, want: dict[str, torch.Tensor]) -> list[str]:
    got = model.state_dict()
    names = sorted(set(got) | set(want))
    return [n for n in names if n not in got or n not in want or not torch.equal(got[n], want[n])]


@pytest.fixture(scope="module")
def teacher_and_tokens(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("hf-sharded")
    build_tiny_qwen2(VOCAB, TinyModelConfig(num_hidden_layers=LAYERS), seed=0).save_pretrained(
        root / "teacher"
    )
    ids = synthetic_tokens(VOCAB, 24, 12, seed=1)
    save_file({"input_ids": ids.contiguous()}, str(root / "tokens.safetensors"))
    return root / "teacher", root / "tokens.safetensors", ids


@pytest.mark.parametrize("world", [2, 4])
def test_multi_rank_export_loads_with_from_pretrained_bit_exact(
    teacher_and_tokens: tuple[Path, Path, torch.Tensor], world: int, tmp_path: Path
) -> None:
    teacher_dir, tokens, ids = teacher_and_tokens
    run = tmp_path / "run.toml"
    run.write_text(RUN.format(teacher=teacher_dir, tokens=tokens, out=tmp_path / "o"))
    _launch(run, world)
    (exp,) = (tmp_path / "o").iterdir()
    export = exp / "student"

    # one shard per rank, each holding only what its rank owns (no rank wrote the whole student)
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    shards = [f"model-{r + 1:05d}-of-{world:05d}.safetensors" for r in range(world)]
    assert sorted(set(index.values())) == shards
    assert not (export / "model.safetensors").exists()
    for r, shard in enumerate(shards):
        own = Ownership.of(LAYERS, r, world)
        with safe_open(str(export / shard), framework="pt") as handle:
            keys = set(handle.keys())
        assert keys == {k for k, f in index.items() if f == shard}
        blocks = {int(k.split(".")[2]) for k in keys if k.startswith("model.layers.")}
        assert blocks == set(own.blocks), (r, blocks)
        assert ("model.embed_tokens.weight" in keys) == own.embed
        assert ({"model.norm.weight", "lm_head.weight"} <= keys) == own.head

    trained = _trained_tensors(exp / "final")
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(export), trust_remote_code=False).eval()
    assert type(plain).__name__ == "Qwen2ForCausalLM"
    assert (plain.config.intermediate_size, plain.config.num_key_value_heads) == (48, 1)
    assert _mismatches(plain, trained) == []

    # the engine's blockwise forward of the student rebuilt from the ranks' checkpoint (not the export)
    teacher = load_hf_model(teacher_dir)
    torch.manual_seed(0)
    student = build_student(teacher, [BlockOverride(**STUDENT)])  # type: ignore[arg-type]
    init = {k: v.clone() for k, v in student.module.state_dict().items()}
    load_checkpoint(exp / "final", model=student, blocks=range(LAYERS), optimizers=None, ctx=DistContext())
    changed = [k for k, v in student.module.state_dict().items() if not torch.equal(v, init[k])]
    assert any(".mlp." in k for k in changed) and any(".self_attn." in k for k in changed)  # it trained
    held = ids[-4:]
    with torch.no_grad():
        hidden, context = student.prepare(held)
        for i in range(LAYERS):
            hidden = student.run_block(i, hidden, context)
        engine_logits = student.logits(hidden)
        torch.testing.assert_close(plain(held).logits, engine_logits, rtol=0, atol=0)

    # the same checks fail on a broken export: an index that lists only rank 0's shard (the last rank's
    # entries missing; transformers reads every tensor of a listed file, so one dropped entry alone is harmless)
    broken = tmp_path / "broken"
    shutil.copytree(export, broken)
    bad = json.loads((broken / "model.safetensors.index.json").read_text())
    bad["weight_map"] = {k: f for k, f in bad["weight_map"].items() if f != shards[-1]}
    (broken / "model.safetensors.index.json").write_text(json.dumps(bad))
    try:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(broken), trust_remote_code=False)
    except Exception:  # refusing the export is a failure too
        return
    assert {"lm_head.weight", f"model.layers.{LAYERS - 1}.mlp.up_proj.weight"} <= set(
        _mismatches(reloaded, trained)
    )
