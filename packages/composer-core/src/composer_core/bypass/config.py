"""Configuration of a bypass run (plain dataclasses, built from dicts by the CLI)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

from composer_core.bypass.keys import canonical_keys
from composer_core.bypass.losses import LOSSES
from composer_core.bypass.protocol import BlockOverride
from composer_core.bypass.student import GqaInit, MlpInit


@dataclass(frozen=True)
class StudentConfig:
    """How the student differs from the teacher and how it is initialised."""

    overrides: tuple[BlockOverride, ...] = ()
    mlp_init_mode: MlpInit = "truncate"
    gqa_init_mode: GqaInit = "average"
    importance_batches: int = 4

    def __post_init__(self) -> None:
        if self.mlp_init_mode not in ("truncate", "importance"):
            raise ValueError(f"student.mlp_init_mode={self.mlp_init_mode!r}: use 'truncate' or 'importance'")
        if self.gqa_init_mode not in ("average", "first"):
            raise ValueError(f"student.gqa_init_mode={self.gqa_init_mode!r}: choose 'average' or 'first'")
        if self.importance_batches < 1:
            raise ValueError(f"student.importance_batches must be >= 1, got {self.importance_batches}")


@dataclass(frozen=True)
class TrainingConfig:
    """Optimisation options; every field changes the result and enters the run identity."""

    steps: int = 100
    micro_batch_size: int = 4
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip: Literal["none", "norm", "value"] = "norm"
    clip_value: float = 1.0
    loss: Literal["normalized_mse", "vectorwise", "per_sample"] = "normalized_mse"
    loss_eps: float = 1e-8
    keys_to_learn: tuple[str, ...] = ("entire_block",)
    loss_scaling: bool = False
    init_scale: float = 2.0**16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"training.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"training: need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(
                f"training.warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}"
            )
        if self.clip not in ("none", "norm", "value"):
            raise ValueError(f"training.clip={self.clip!r}: choose 'none', 'norm' or 'value'")
        if self.clip != "none" and not self.clip_value > 0:
            raise ValueError(f"training.clip_value must be > 0, got {self.clip_value}")
        if self.loss not in LOSSES:
            raise ValueError(f"training.loss={self.loss!r}: choose one of {sorted(LOSSES)}")
        object.__setattr__(self, "keys_to_learn", canonical_keys(self.keys_to_learn))
        object.__setattr__(self, "betas", tuple(self.betas))


@dataclass(frozen=True)
class RunConfig:
    """Where and how often to save/validate. ``val_every``/``best_metric`` decide ``best/``.

    ``keep_last`` > 0 keeps only the newest K ``step-N`` checkpoints (``best``/``final`` are
    always kept); 0 keeps every one.
    """

    output_dir: str = "bypass-runs"
    name: str = "bypass"
    save_every: int = 0
    keep_last: int = 0
    val_every: int = 0
    val_sequences: int = 0
    best_metric: Literal["lm_loss", "block_loss"] = "lm_loss"

    def __post_init__(self) -> None:
        for name in ("save_every", "val_every", "val_sequences", "keep_last"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"run.{name} must be an integer, got {getattr(self, name)!r}")
            if getattr(self, name) < 0:
                raise ValueError(f"run.{name} must be >= 0, got {getattr(self, name)}")
        if self.val_every and not self.val_sequences:
            raise ValueError("run.val_every > 0 needs run.val_sequences > 0 held-out sequences")
        if self.best_metric not in ("lm_loss", "block_loss"):
            raise ValueError(f"run.best_metric={self.best_metric!r}: choose 'lm_loss' or 'block_loss'")
        if not self.name or "/" in self.name:
            raise ValueError(f"run.name={self.name!r} must be a non-empty name without '/'")


@dataclass(frozen=True)
class BypassConfig:
    """A whole run: student shape, training and run options."""

    student: StudentConfig = field(default_factory=StudentConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def identity_fields(self) -> dict[str, Any]:
        """Every option that changes the trained weights or ``best/`` (not paths, not save cadence)."""
        return {
            "student": asdict(self.student),
            "training": asdict(self.training),
            "validation": {k: getattr(self.run, k) for k in ("val_every", "val_sequences", "best_metric")},
        }

    def with_student(self, student: StudentConfig) -> BypassConfig:
        return replace(self, student=student)


def _build(cls: type[Any], data: Mapping[str, Any], where: str) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"[{where}] unknown keys {sorted(unknown)}; allowed: {sorted(names)}")
    return cls(**data)


def override_from_dict(data: Mapping[str, Any]) -> BlockOverride:
    """``{"blocks": [0, 1], "intermediate_size": 32, ...}`` → :class:`BlockOverride`."""
    data = dict(data)
    if data.get("blocks") is not None:
        data["blocks"] = tuple(int(b) for b in data["blocks"])
    return _build(BlockOverride, data, "student.overrides")  # type: ignore[no-any-return]


def student_from_dict(data: Mapping[str, Any]) -> StudentConfig:
    data = dict(data)
    data["overrides"] = tuple(override_from_dict(o) for o in data.get("overrides", []))
    return _build(StudentConfig, data, "student")  # type: ignore[no-any-return]


def config_from_dict(data: Mapping[str, Any]) -> BypassConfig:
    """Build a :class:`BypassConfig` from ``student``/``training``/``run`` tables."""
    unknown = set(data) - {"student", "training", "run"}
    if unknown:
        raise ValueError(f"bypass config: unknown tables {sorted(unknown)}; allowed: student, training, run")
    return BypassConfig(
        student=student_from_dict(data.get("student", {})),
        training=_build(TrainingConfig, data.get("training", {}), "training"),
        run=_build(RunConfig, data.get("run", {}), "run"),
    )
