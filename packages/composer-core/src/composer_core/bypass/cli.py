"""``composer-bypass --config run.toml``: bypass distillation from a config file.

The file (TOML, or YAML with the ``yaml`` extra) has tables ``teacher`` (``kind`` =
``"reference"`` | ``"hf"``, ``path``), ``data`` (``path`` to a safetensors file with
``input_ids [N, T]``, or ``synthetic = {vocab_size, num_sequences, seq_len, seed}``),
``student``, ``training``, ``run`` (see :mod:`composer_core.bypass.config`), optional
``output`` (``plot``: true/false, default = when matplotlib is installed) and an optional
list ``sweep`` of student tables (one run each). Several processes: ``torchrun --nproc-per-node N
-m composer_core.bypass.cli --config run.toml`` (gloo on CPU, NCCL when CUDA is available).

exit status: 0 done or skipped (already complete; a skipped run writes nothing); 2 bad config/input
or unusable checkpoint; 3 an output file cannot be written (disk full, read-only or unwritable
directory); 4 another rank died (one line naming it); errors are one line naming the cause.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import json
import os
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from composer_core.bypass.checkpoint import read_json
from composer_core.bypass.config import config_from_dict, student_from_dict
from composer_core.bypass.data import load_tokens, synthetic_tokens
from composer_core.bypass.distributed import DistContext, PeerDiedError
from composer_core.bypass.export import export_sharded
from composer_core.bypass.hf import load_hf_model
from composer_core.bypass.protocol import BlockwiseModel
from composer_core.bypass.reference import ReferenceDecoder
from composer_core.bypass.report import loss_table, plot_block_losses
from composer_core.bypass.train import BypassResult, run_bypass

TABLES = {"teacher", "data", "student", "training", "run", "output", "sweep"}


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML (``.toml``) or YAML (``.yaml``/``.yml``, extra ``yaml``) run file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {str(p)!r} does not exist")
    if p.suffix == ".toml":
        with open(p, "rb") as f:
            data = tomllib.load(f)
    elif p.suffix in (".yaml", ".yml"):
        try:
            yaml = importlib.import_module("yaml")
        except ImportError as exc:
            raise ImportError("YAML run files need PyYAML: pip install 'composer-core[yaml]'") from exc
        data = yaml.safe_load(p.read_text())
    else:
        raise ValueError(f"--config {str(p)!r}: use a .toml, .yaml or .yml file")
    if not isinstance(data, dict):
        raise ValueError(f"{p}: the top level must be a table/mapping")
    unknown = set(data) - TABLES
    if unknown:
        raise ValueError(f"{p}: unknown tables {sorted(unknown)}; allowed: {sorted(TABLES)}")
    return data


def load_teacher(spec: dict[str, Any], ctx: DistContext | None = None) -> BlockwiseModel:
    """This rank's share of the teacher: its blocks (+ the embedding on the first rank), read from disk."""
    kind, path = spec.get("kind"), spec.get("path")
    unknown = set(spec) - {"kind", "path", "trust_remote_code"}
    if unknown:
        raise ValueError(f"[teacher] unknown keys {sorted(unknown)}")
    if not path:
        raise ValueError("[teacher] needs path = <model directory>")
    if kind not in ("reference", "hf"):
        raise ValueError(f"[teacher] kind={kind!r}: choose 'reference' or 'hf'")
    ctx = ctx or DistContext()
    cfg = read_json(Path(path) / "config.json", "check [teacher] path")
    key = "num_layers" if kind == "reference" else "num_hidden_layers"
    if not isinstance(cfg.get(key), int):
        raise ValueError(f"[teacher] {path}/config.json has no integer {key!r}; is kind={kind!r} right?")
    own = ctx.ownership(int(cfg[key]))
    if kind == "reference":
        return ReferenceDecoder.load(path, own, head=False)
    trust = bool(spec.get("trust_remote_code", False))
    return load_hf_model(path, trust_remote_code=trust, ownership=own, head=False, device=ctx.device)


def load_data(spec: dict[str, Any]) -> Tensor:
    if "path" in spec and "synthetic" in spec:
        raise ValueError("[data] give either path or synthetic, not both")
    if "path" in spec:
        return load_tokens(spec["path"], spec.get("key", "input_ids"))
    if "synthetic" in spec:
        s = dict(spec["synthetic"])
        return synthetic_tokens(
            int(s["vocab_size"]), int(s["num_sequences"]), int(s["seq_len"]), int(s.get("seed", 0))
        )
    raise ValueError(
        "[data] needs path = <tokens.safetensors> or synthetic = {vocab_size, num_sequences, seq_len}"
    )


def _init_distributed() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")


EXIT_BAD_INPUT = 2
EXIT_CANNOT_WRITE = 3
EXIT_PEER_DIED = 4


def _finish(result: BypassResult, plot: bool | None, ctx: DistContext) -> None:
    """Every rank writes its shard of the student; rank 0 the table, history.json and the plot (a skipped
    run rewrites nothing that exists)."""
    exp = result.experiment_dir
    already = result.skipped and (exp / "student" / "config.json").is_file()
    if not already:
        export_sharded(result.student, exp / "student", ctx)
    if not ctx.is_main:
        return
    history = exp / "history.json"
    if not (result.skipped and history.is_file()):
        history.write_text(json.dumps({"history": result.history, "validation": result.validation}, indent=1))
    print(
        f"\nrun {result.run_id[:16]} ({'skipped: already complete' if result.skipped else 'trained'}) -> {exp}"
    )
    print(loss_table(result.history, result.validation))
    print(f"student {'already saved in' if already else 'saved to'} {exp / 'student'}")
    if already:
        return
    want = plot
    if want is None:
        want = importlib.util.find_spec("matplotlib") is not None
        if not want:
            print("no plot: install matplotlib with pip install 'composer-core[plot]'")
    if want:
        print(f"plot: {plot_block_losses(result.history, exp / 'block_loss.png', title=exp.name)}")


def main(argv: Sequence[str] | None = None) -> int:
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(prog="composer-bypass", description=doc[0], epilog=doc[-1])
    parser.add_argument("--config", required=True, help="run file (.toml, or .yaml with composer-core[yaml])")
    parser.add_argument("--no-resume", action="store_true", help="start over instead of resuming")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--keep-last",
        type=int,
        metavar="K",
        help="keep only the newest K step-N checkpoints (best/final always kept); overrides run.keep_last",
    )
    args = parser.parse_args(argv)
    if args.keep_last is not None and args.keep_last < 0:
        parser.error(f"--keep-last must be >= 0, got {args.keep_last}")
    try:
        return _run(args)
    except (ValueError, ImportError, PeerDiedError) as exc:
        print(f"composer-bypass: error: {exc}", file=sys.stderr)
        return EXIT_PEER_DIED if isinstance(exc, PeerDiedError) else EXIT_BAD_INPUT
    except OSError as exc:  # disk full, read-only, permissions: one line, no traceback
        code = errno.errorcode.get(exc.errno or 0, "")
        cause = f"{exc.strerror or exc}{f' ({code})' if code else ''}"
        print(
            f"composer-bypass: error: cannot write {exc.filename or 'an output file'}: {cause}; free space, "
            "make run.output_dir writable or choose another one",
            file=sys.stderr,
        )
        return EXIT_CANNOT_WRITE


def _run(args: argparse.Namespace) -> int:
    raw = read_config_file(args.config)
    plot = raw.get("output", {}).get("plot")
    sweep = raw.get("sweep", [])
    base = config_from_dict({k: raw[k] for k in ("student", "training", "run") if k in raw})
    if args.keep_last is not None:
        base = dataclasses.replace(base, run=dataclasses.replace(base.run, keep_last=args.keep_last))
    configs = [base.with_student(student_from_dict(s)) for s in sweep] if sweep else [base]
    _init_distributed()
    ctx = DistContext.current()
    processes = ctx.processes()  # to name a rank whose death breaks a collective
    try:
        teacher = load_teacher(dict(raw.get("teacher", {})), ctx)
        tokens = load_data(dict(raw.get("data", {})))
        for config in configs:
            result = run_bypass(
                teacher, tokens, config, resume=not args.no_resume, progress=not args.no_progress
            )
            _finish(result, plot, ctx)
            ctx.barrier()
    except RuntimeError:
        if ctx.active:
            ctx.raise_if_peer_died(processes)
        raise
    finally:
        if ctx.active:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
