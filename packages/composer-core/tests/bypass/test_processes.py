"""Real processes: kill -9 (mid-save) and resume, 2-process gloo == 1 process, rank errors.

The kill test uses the documented fault hook ``COMPOSER_BYPASS_KILL_AT=<checkpoint>:<phase>``:
the child sends itself SIGKILL at that exact point of the save (a real ``kill -9``, placed
deterministically instead of by a racy timer).
"""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from composer_core.bypass import config_from_dict, run_bypass
from composer_core.bypass.checkpoint import KILL_ENV, is_complete

SECTIONS: dict[str, Any] = {
    "student": {
        "overrides": [{"intermediate_size": 8, "num_key_value_heads": 2}, {"blocks": [2], "ffn_no_op": True}]
    },
    "training": {"steps": 6, "micro_batch_size": 4, "lr": 3e-3, "warmup_steps": 1, "grad_accum": 2},
}


def _toml_value(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)


def _write_run(
    root: Path, name: str, run: dict[str, Any], teacher_dir: Path, tokens: Path
) -> tuple[Path, dict[str, Any]]:
    tables = {
        **SECTIONS,
        "run": {"output_dir": str(root / name), **run},
        "teacher": {"kind": "reference", "path": str(teacher_dir)},
        "data": {"path": str(tokens)},
        "output": {"plot": False},
    }
    text = "\n".join(
        f"[{t}]\n" + "\n".join(f"{k} = {_toml_value(v)}" for k, v in body.items())
        for t, body in tables.items()
    )
    path = root / f"{name}.toml"
    path.write_text(text + "\n")
    return path, {k: tables[k] for k in ("student", "training", "run")}


@pytest.fixture(scope="module")
def setup(S: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("bypass-proc")
    teacher = S.teacher(num_layers=3)
    teacher.save(root / "teacher")
    ids = S.tokens(32)
    tokens = S.write_tokens(root / "tokens.safetensors", ids)
    _, ref_cfg = _write_run(root, "ref", {"save_every": 2}, root / "teacher", tokens)
    ref = run_bypass(type(teacher).load(root / "teacher"), ids, config_from_dict(ref_cfg), progress=False)
    return {"root": root, "teacher": root / "teacher", "tokens": tokens, "ids": ids, "ref": ref}


# Appended to a script run by each rank: print which gloo threads are still alive (Linux /proc).
_PRINT_GLOO_THREADS = """
import json as _json, os as _os
_names = []
for _tid in _os.listdir("/proc/self/task"):
    try:
        _names.append(open(f"/proc/self/task/{_tid}/comm").read().strip())
    except OSError:
        pass
print(_json.dumps(sorted(n for n in _names if "gloo" in n)))
"""
# The CLI's main() in-process, then the gloo threads still alive, then main()'s exit status.
_MAIN_THEN_THREADS = (
    "import sys\nfrom composer_core.bypass.cli import main\nrc = main(sys.argv[1:])\n"
    + _PRINT_GLOO_THREADS
    + "sys.exit(rc)\n"
)


def _cli_args(config: Path, *, threads: bool = False) -> list[str]:
    entry = ["-c", _MAIN_THEN_THREADS] if threads else ["-m", "composer_core.bypass.cli"]
    return [*entry, "--config", str(config), "--no-progress"]


def _cli(config: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return _python(_cli_args(config), env)


def _python(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize(
    ("checkpoint", "phase"),
    [
        ("step-00000004", "blocks"),
        ("step-00000004", "marker"),
        ("step-00000004", "rename"),
        ("final", "state"),
    ],
)
def test_kill_minus_9_mid_save_then_resume_is_bit_identical(
    S: Any, setup: dict[str, Any], checkpoint: str, phase: str
) -> None:
    root = setup["root"]
    toml, cfg = _write_run(
        root, f"kill-{checkpoint}-{phase}", {"save_every": 2}, setup["teacher"], setup["tokens"]
    )
    proc = _cli(toml, {KILL_ENV: f"{checkpoint}:{phase}"})
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err
    exp = next((root / f"kill-{checkpoint}-{phase}").iterdir())
    if phase != "rename":
        assert (exp / f"{checkpoint}.partial").is_dir() and not (exp / checkpoint).exists()
        assert not is_complete(exp / "final")
    teacher = type(S.teacher()).load(setup["teacher"])
    if phase == "rename":
        resumed = run_bypass(teacher, setup["ids"], config_from_dict(cfg), progress=False)
    else:
        with pytest.warns(UserWarning, match="interrupted save"):
            resumed = run_bypass(teacher, setup["ids"], config_from_dict(cfg), progress=False)
        assert (exp / "aside" / f"{checkpoint}.partial-0").is_dir()
    ref = setup["ref"]
    assert resumed.run_id == ref.run_id and resumed.history == ref.history
    got, want = S.final_blocks(resumed.experiment_dir), S.final_blocks(ref.experiment_dir)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    for i in range(2):  # optimizer state is bit-identical too
        a = torch.load(exp / "final" / "optim" / f"block-{i:04d}.pt", weights_only=True)["optimizer"]["state"]
        b = torch.load(ref.experiment_dir / f"final/optim/block-{i:04d}.pt", weights_only=True)["optimizer"][
            "state"
        ]
        assert all(torch.equal(a[j]["exp_avg_sq"], b[j]["exp_avg_sq"]) for j in b)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(config: Path, world: int, *, threads: bool = False) -> list[tuple[int, str, str]]:
    return _run_ranks(_cli_args(config, threads=threads), world)


def _start_ranks(
    args: list[str], world: int, rank_env: dict[int, dict[str, str]] | None = None
) -> list[subprocess.Popen[str]]:
    """``python <args>`` as ranks 0..world-1 of one gloo group on 127.0.0.1 (``rank_env``: more env per rank)."""
    port = str(_free_port())
    return [
        _python(
            args,
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "WORLD_SIZE": str(world),
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                **(rank_env or {}).get(r, {}),
            },
        )
        for r in range(world)
    ]


def _run_ranks(args: list[str], world: int) -> list[tuple[int, str, str]]:
    """``python <args>`` as ranks 0..world-1 of one gloo group on 127.0.0.1: (exit status, stdout, stderr)."""
    procs = _start_ranks(args, world)
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        results.append((p.returncode, out, err))
    return results


def test_two_process_gloo_equals_one_process(S: Any, setup: dict[str, Any]) -> None:
    root = setup["root"]
    toml, _ = _write_run(
        root, "two", {"save_every": 2, "val_every": 3, "val_sequences": 8}, setup["teacher"], setup["tokens"]
    )
    _, one_cfg = _write_run(
        root, "one", {"save_every": 2, "val_every": 3, "val_sequences": 8}, setup["teacher"], setup["tokens"]
    )
    one = run_bypass(
        type(S.teacher()).load(setup["teacher"]), setup["ids"], config_from_dict(one_cfg), progress=False
    )
    results = _launch(toml, 2)
    assert all(rc == 0 for rc, _, _ in results), results
    exp = next((root / "two").iterdir())
    assert exp.name == one.experiment_dir.name  # same run identity whatever the world size
    got, want = S.final_blocks(exp), S.final_blocks(one.experiment_dir)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    history = json.loads((exp / "history.json").read_text())
    assert history["history"] == one.history and history["validation"] == one.validation
    assert sorted(p.name for p in (exp / "final" / "rng").iterdir()) == ["rank-0000.pt", "rank-0001.pt"]
    assert "assembled student LM loss" in results[0][1]  # rank 0 prints the table
    # two ranks export two shards + the index (no rank holds the whole student)
    index = json.loads((exp / "student" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_more_ranks_than_blocks_fails_cleanly_on_every_rank(
    S: Any, setup: dict[str, Any], tmp_path: Path
) -> None:
    one_block = S.teacher(num_layers=1)
    one_block.save(tmp_path / "teacher1")
    toml, _ = _write_run(tmp_path, "tiny", {}, tmp_path / "teacher1", setup["tokens"])
    text = toml.read_text().replace('{"blocks": [2], "ffn_no_op": true}', "").replace("}, ]", "}]")
    toml.write_text(text)
    results = _launch(toml, 2)
    errors = {err.strip().splitlines()[-1] for _, _, err in results}
    assert [rc for rc, _, _ in results] == [2, 2]
    assert errors == {
        "composer-bypass: error: world_size=2 exceeds the number of blocks (1): every rank needs at "
        "least one block; run with at most 1 processes"
    }


_INIT = {
    "cli": "from composer_core.bypass.cli import _init_distributed\n_init_distributed()\n",
    # a user's torchrun script: imports the engine, then initialises the group itself
    "own_script": "import composer_core.bypass\ndist.init_process_group('gloo')\n",
}


@pytest.mark.parametrize("init", sorted(_INIT))
def test_destroy_process_group_ends_its_threads_whatever_is_imported_later(init: str) -> None:
    """Upstream modules imported after init (torch.distributed.nn binds ``group.WORLD`` as a default
    argument; torch._dynamo imports it, as the optimizer step does) must not keep the default group, and its
    gloo threads, alive past destroy_process_group: they would die in interpreter teardown (SIGABRT,
    "terminate called without an active exception") on a rank that already finished."""
    script = (
        "import torch.distributed as dist\n" + _INIT[init] + "import torch._dynamo  # imported after init\n"
        "dist.destroy_process_group()\n" + _PRINT_GLOO_THREADS
    )
    results = _run_ranks(["-c", script], 2)
    assert [rc for rc, _, _ in results] == [0, 0], results
    assert [out.strip().splitlines()[-1] for _, out, _ in results] == ["[]", "[]"]


def test_rank0_decision_error_reaches_every_rank(setup: dict[str, Any], tmp_path: Path) -> None:
    """A failure in a rank-0 decision (here: a foreign manifest) is broadcast instead of hanging rank 1."""
    toml, _ = _write_run(tmp_path, "foreign", {}, setup["teacher"], setup["tokens"])
    exp = tmp_path / "foreign" / setup["ref"].experiment_dir.name
    exp.mkdir(parents=True)
    (exp / "bypass_state.json").write_text(json.dumps({"run_id": "f" * 64, "status": "running"}))
    results = _launch(toml, 2, threads=True)
    assert [rc for rc, _, _ in results] == [2, 2]
    for _, out, err in results:
        assert "rank 0 failed: ValueError:" in err and "belongs to run" in err
        # No process group outlives main(): one that did (torch.distributed.nn binds the default group
        # as a default argument when imported after init) kept its gloo threads running into interpreter
        # teardown, where they died with "terminate called without an active exception" (exit -6).
        assert out.strip().splitlines()[-1] == "[]"


def test_dead_rank_is_named_by_every_survivor(setup: dict[str, Any], tmp_path: Path) -> None:
    """Issue 50: rank 2 of 3 is SIGKILLed mid-run (after writing its blocks of step 2, before the gather).
    Each survivor used to print a ~30-line gloo traceback naming no rank (exit 1); now one line naming
    the dead rank, its host and pid, and exit 4."""
    toml, _ = _write_run(tmp_path, "dead-rank", {"save_every": 2}, setup["teacher"], setup["tokens"])
    procs = _start_ranks(_cli_args(toml), 3, {2: {KILL_ENV: "step-00000002:blocks"}})
    results = [(p.returncode, err) for p in procs for _, err in [p.communicate(timeout=120)]]
    assert results[2][0] == -signal.SIGKILL, results[2]
    for rank, (rc, err) in enumerate(results[:2]):
        lines = err.strip().splitlines()
        assert (rc, len(lines)) == (4, 1), f"rank {rank}: exit {rc}\n{err}"
        assert lines[0].startswith("composer-bypass: error: "), lines
        assert f"rank 2 (host {socket.gethostname()}, pid {procs[2].pid})" in lines[0], lines
        assert f"died (killed or crashed), so rank {rank} stopped" in lines[0], lines
