"""Bypass distillation (Puzzle, arXiv 2411.19146): train a cheaper student block by block from a teacher (the
README's "Bypass engine"). Entry points: :func:`run_bypass`, :func:`run_sweep`, the ``composer-bypass`` script.
"""

from composer_core.bypass.config import (
    BypassConfig,
    RunConfig,
    StudentConfig,
    TrainingConfig,
    config_from_dict,
)
from composer_core.bypass.distributed import DistContext, Ownership, partition_blocks
from composer_core.bypass.export import load_model
from composer_core.bypass.keys import canonical_keys
from composer_core.bypass.losses import normalized_mse, per_sample_normalized_mse, vectorwise_normalized_mse
from composer_core.bypass.optim import cosine_lr
from composer_core.bypass.protocol import (
    AttentionConfig,
    BlockConfig,
    BlockOverride,
    BlockwiseModel,
    FFNConfig,
    resolve_block_configs,
)
from composer_core.bypass.reference import ReferenceConfig, ReferenceDecoder
from composer_core.bypass.shard import materialised_bytes
from composer_core.bypass.student import build_student, init_from_teacher
from composer_core.bypass.train import BypassResult, run_bypass, run_sweep

__all__ = [
    "AttentionConfig",
    "BlockConfig",
    "BlockOverride",
    "BlockwiseModel",
    "BypassConfig",
    "BypassResult",
    "DistContext",
    "FFNConfig",
    "Ownership",
    "ReferenceConfig",
    "ReferenceDecoder",
    "RunConfig",
    "StudentConfig",
    "TrainingConfig",
    "build_student",
    "canonical_keys",
    "config_from_dict",
    "cosine_lr",
    "init_from_teacher",
    "load_model",
    "materialised_bytes",
    "normalized_mse",
    "partition_blocks",
    "per_sample_normalized_mse",
    "resolve_block_configs",
    "run_bypass",
    "run_sweep",
    "vectorwise_normalized_mse",
]
