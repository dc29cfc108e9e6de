"""Run lifecycle of ``composer-train``: exit codes (0 finished, 1 a traceback, 2 bad arguments or config,
3 bad dataset, 4 the ``--env`` environment faulted, 5 a reward function failed, 130/143 SIGINT/SIGTERM; what each
says and what is kept: the package README's "Exit codes and what is kept"), output-directory rules, valid JSON,
checkpoints (TRL's own plus :class:`ComposerState`'s file; README: they resume bit-exactly on CPU), signals.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from transformers import TrainerCallback

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_DATA = 3
EXIT_ENV = 4
EXIT_REWARD = 5

COMPOSER_STATE = "composer_state.json"
OWNED_OUTPUTS = (
    "metrics-*.jsonl",
    "metrics.png",
    "summary.json",
    "model",
    "trainer-*",
)
"""What ``composer-train`` writes into its output directory (``--overwrite_output_dir`` removes only these)."""


class UsageError(Exception):
    """Bad arguments or config: one line on stderr, exit 2."""

    exit_code = EXIT_USAGE


class DataError(UsageError):
    """Bad dataset: one line on stderr, exit 3, nothing written."""

    exit_code = EXIT_DATA


class EnvFault(UsageError):
    """The ``--env`` environment faulted (composer_core.envs.EnvError): one line on stderr, exit 4."""

    exit_code = EXIT_ENV


class RewardFault(UsageError):
    """A reward function failed during training (composer_trl.guards.RewardFunctionError): one line, exit 5."""

    exit_code = EXIT_REWARD


def json_safe(value: Any, path: str = "", flagged: list[str] | None = None) -> Any:
    """``value`` with every non-finite float replaced by ``None``; the dotted paths go into ``flagged``."""
    if isinstance(value, float) and not math.isfinite(value):
        if flagged is not None:
            flagged.append(path)
        return None
    if isinstance(value, dict):
        return {k: json_safe(v, f"{path}.{k}" if path else str(k), flagged) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v, f"{path}[{i}]", flagged) for i, v in enumerate(value)]
    return value


def dumps(value: dict[str, Any], **kw: Any) -> str:
    """Strict JSON (never a bare NaN): non-finite floats become null, listed under ``"nonfinite"``."""
    flagged: list[str] = []
    clean = json_safe(value, flagged=flagged)
    if flagged:
        clean["nonfinite"] = flagged
    return json.dumps(clean, allow_nan=False, **kw)


def prepare_output_dir(out: Path, *, overwrite: bool, resume: bool) -> None:
    """Refuse a non-empty ``out`` unless resuming or ``overwrite`` (which removes composer-train's outputs)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output_dir {str(out)!r} is a file; pass a directory.")
    if resume or not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise UsageError(
            f"--output_dir {str(out)!r} is not empty; pass --overwrite_output_dir to replace its run, "
            "--resume_from_checkpoint last to continue it, or another --output_dir."
        )
    for pattern in OWNED_OUTPUTS:
        for p in out.glob(pattern):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def discard_failed_run(
    out: Path, *, existed: bool, before: set[Path], trainer_dir: Path, parts: Sequence[str] = ()
) -> str:
    """After a run failed in training: keep it if ``trainer_dir`` holds a complete checkpoint, else remove what the
    run wrote (``out`` itself when the run created it, otherwise the entries not in ``before``). Returns the
    clause that says which."""
    complete = [
        p for p in trainer_dir.glob("checkpoint-*") if _step_of(p) >= 0 and not checkpoint_problems(p, parts)
    ]
    if complete:
        newest = max(complete, key=_step_of)
        return (
            f"the complete checkpoints are kept (newest {newest}); continue with --resume_from_checkpoint last "
            "once fixed"
        )
    if not existed:
        shutil.rmtree(out, ignore_errors=True)
        return f"nothing kept ({out} removed)"
    for p in list(out.iterdir()) if out.is_dir() else []:
        if p not in before:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return f"nothing kept (what this run wrote in {out} removed)"


def _step_of(p: Path) -> int:
    m = re.fullmatch(r"checkpoint-(\d+)", p.name)
    return int(m.group(1)) if m else -1


WEIGHT_FILES = (
    "model.safetensors",
    "adapter_model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
)


def checkpoint_problems(ckpt: Path, extra: Sequence[str] = ()) -> list[str]:
    """Why ``ckpt`` cannot be resumed (empty: complete). Missing parts: a readable ``trainer_state.json``, the
    optimizer, the model's weights, composer's state and ``extra`` files (e.g. the SDPO teacher's); transformers
    writes a checkpoint in place, so a run killed while saving leaves one that only this check tells apart. Files
    that do not read back (a copy or a save cut short): a ``.json`` that does not parse, a ``.safetensors`` whose
    header safetensors refuses (it must name exactly the file's bytes), a torch ``.pt``/``.pth``/``.bin`` whose zip
    directory (written last) is missing. Each reads only headers, not the tensors."""
    missing = []
    try:
        json.loads((ckpt / "trainer_state.json").read_text())["global_step"]
    except (OSError, ValueError, KeyError):
        missing.append("trainer_state.json")
    if not (ckpt / "optimizer.pt").is_file():
        missing.append("optimizer.pt")
    if not any((ckpt / name).is_file() for name in WEIGHT_FILES):
        missing.append("model weights")
    missing += [name for name in (COMPOSER_STATE, *extra) if not (ckpt / name).is_file()]
    out = [f"no {', '.join(missing)}"] if missing else []
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        try:
            _read_back(path)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, SafetensorError) as e:
            out.append(f"{path.relative_to(ckpt)} does not read back ({e})")
    return out


def _read_back(path: Path) -> None:
    if path.suffix == ".json":
        json.loads(path.read_text())
    elif path.suffix == ".safetensors":
        with safe_open(str(path), "pt"):
            pass
    elif path.suffix in (".pt", ".pth", ".bin"):
        zipfile.ZipFile(path).close()


def resolve_checkpoint(value: str, trainer_dir: Path, extra: Sequence[str] = ()) -> Path:
    """``last`` → the newest *complete* ``checkpoint-<step>`` in ``trainer_dir`` (:func:`checkpoint_problems`; newer
    incomplete ones are set aside and named in one line); otherwise an existing complete checkpoint path."""
    if value == "last":
        found = sorted((p for p in trainer_dir.glob("checkpoint-*") if _step_of(p) >= 0), key=_step_of)
        if not found:
            raise UsageError(
                f"--resume_from_checkpoint last: no checkpoint-<step> in {str(trainer_dir)!r}; "
                "run without it (and with --save_steps N to write checkpoints)."
            )
        skipped: list[str] = []
        for ckpt in reversed(found):
            problems = checkpoint_problems(ckpt, extra)
            if not problems:
                if skipped:
                    print(
                        f"composer-train: resuming from {ckpt.name}; set aside incomplete {'; '.join(skipped)}"
                    )
                return ckpt
            skipped.append(f"{ckpt.name} ({', '.join(problems)})")
        raise UsageError(
            f"--resume_from_checkpoint last: no complete checkpoint in {str(trainer_dir)!r} ({'; '.join(skipped)}); "
            "start the run again without --resume_from_checkpoint."
        )
    p = Path(value)
    if not (p / "trainer_state.json").is_file():
        raise UsageError(
            f"--resume_from_checkpoint {value!r} is not a checkpoint directory (no trainer_state.json); "
            f"pass `last` or a path like {trainer_dir}/checkpoint-<step>."
        )
    problems = checkpoint_problems(p, extra)
    if problems:
        raise UsageError(
            f"--resume_from_checkpoint {value!r} is incomplete ({', '.join(problems)}: a run killed while "
            "saving it?); pass `last` to take the newest complete checkpoint."
        )
    return p


def checkpoint_step(ckpt: Path) -> int:
    """The global step a checkpoint was written at (its ``trainer_state.json``)."""
    return int(json.loads((ckpt / "trainer_state.json").read_text())["global_step"])


class ComposerState(TrainerCallback):
    """Saves composer's own state next to each TRL checkpoint and restores it on resume.

    Today that is the TAID scheduler (``t``, momentum, previous loss, step count) of
    :class:`~composer_trl.ComposerGRPOTrainer`; plain ``GRPOTrainer`` has none and writes ``{}``.
    """

    def __init__(self, trainer: Any, resume_from: Path | None) -> None:
        self.trainer = trainer
        self.resume_from = resume_from

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.resume_from is None:
            return
        path = self.resume_from / COMPOSER_STATE
        if not path.is_file():
            raise UsageError(
                f"checkpoint {str(self.resume_from)!r} has no {COMPOSER_STATE}; it was not written "
                "by composer-train, so composer's state (TAID) cannot be restored."
            )
        saved = json.loads(path.read_text())
        taid = getattr(self.trainer, "_taid", None)
        if taid is not None:
            if saved.get("taid") is None:
                raise UsageError(f"{path}: no TAID state saved, but this run uses sdpo_wrapper='taid'.")
            taid.load_state_dict(saved["taid"])

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        taid = getattr(self.trainer, "_taid", None)
        payload = {"global_step": state.global_step, "taid": taid.state_dict() if taid is not None else None}
        if ckpt.is_dir():
            (ckpt / COMPOSER_STATE).write_text(dumps(payload))


class StopOnSignal(TrainerCallback):
    """SIGINT/SIGTERM: finish the current optimiser step, save a checkpoint, stop; a second signal kills.

    ``received`` holds the signal's name after one arrived; the caller writes the summary and exits
    128 + signal number (130 / 143).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: str | None = None
        self.code = EXIT_OK
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # second signal: stop now
            self.uninstall()
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum).name
        self.code = 128 + signum

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.received is not None:
            control.should_save = True
            control.should_training_stop = True
        return control
