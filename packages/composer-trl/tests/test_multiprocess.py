"""Two CPU processes via torchrun + accelerate (DDP over gloo): the channels' global counts and metric
reductions are collective, parameters stay in sync, every channel is non-zero."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(tmp_path, model_dir, *extra: str) -> tuple[dict, dict]:
    worker = Path(__file__).with_name("mp_worker.py")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MASTER_ADDR": "127.0.0.1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(worker),
        str(tmp_path),
        str(model_dir),
        *extra,
    ]
    env["COMPOSER_MP_DUMP_AFTER"] = "240"  # a hung collective dumps the stacks and exits instead of hanging
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired as exc:  # torchrun itself hung: show what the ranks printed
        out, err = (
            x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (exc.stdout, exc.stderr)
        )
        pytest.fail(f"torchrun did not end within 300 s:\n{out[-3000:]}\n{err[-5000:]}")
    if res.returncode != 0:
        pytest.fail(f"torchrun failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}")
    return json.loads((tmp_path / "rank0.json").read_text()), json.loads(
        (tmp_path / "rank1.json").read_text()
    )


def test_two_process_training_keeps_ranks_in_sync(tmp_path, model_dir):
    r0, r1 = _torchrun(tmp_path, model_dir)
    assert r0["world"] == r1["world"] == 2
    assert "MULTI_CPU" in r0["distributed_type"]
    assert r0["param_sum_before"] == r1["param_sum_before"]
    assert r0["param_sum_after"] == r1["param_sum_after"] != r0["param_sum_before"]
    logs = r0["logs"]
    assert len(logs) == 2
    for row in logs:
        assert row["composer/loss/sdpo"] > 0 and row["composer/loss/replay"] > 0
        # 2 processes x 4 completions = 2 prompts: one pair each, counted across both ranks
        assert row["composer/replay/pairs"] == 2


def test_two_processes_share_a_group_of_successful_siblings_and_one_ema_teacher(tmp_path, model_dir):
    """One group of 8 completions split across two ranks: the successes on one rank teach the other's failures
    (contexts built over the gathered group), and both ranks end with the same student and EMA teacher."""
    r0, r1 = _torchrun(tmp_path, model_dir, "success-ema")
    assert r0["param_sum_after"] == r1["param_sum_after"] != r0["param_sum_before"]
    assert r0["teacher_sum"] == r1["teacher_sum"] not in (None, r0["param_sum_before"])
    for row in r0["logs"]:
        assert (row["composer/loss/sdpo"] > 0) == (row["composer/sdpo/success_group_fraction"] > 0)
    assert any(row["composer/sdpo/success_group_fraction"] > 0 for row in r0["logs"])


def test_two_processes_count_on_policy_pairs_globally_and_agree_on_channel_grad_norms(tmp_path, model_dir):
    """replay_pairs='on_policy' with one group of 8 split across two ranks: the pairs logged per step are the
    failures (reward < 0.3) of both ranks, and the per-channel gradient norms (reduced like DDP's gradient) agree."""
    r0, r1 = _torchrun(tmp_path, model_dir, "on-policy")
    assert r0["param_sum_after"] == r1["param_sum_after"] != r0["param_sum_before"]
    assert len(r0["logs"]) == 2
    for step, row in enumerate(r0["logs"]):
        failures = sum(r < 0.3 for r in r0["rewards"][step] + r1["rewards"][step])
        assert row["composer/replay/pairs"] == failures
        assert (row["composer/loss/replay"] > 0) == (failures > 0)
        for key in ("composer/grad_norm/policy", "composer/grad_norm/replay"):
            assert row[key] == r1["logs"][step][key]
    assert any(row["composer/replay/pairs"] > 0 for row in r0["logs"])
