"""composer_core: the 3-channel RL post-training objective in pure torch.

``total = policy (GRPO family) + α·SDPO (hinted self-distillation) + β·trace-replay preference (DPO/SimPO)``.
See :func:`composer_core.loss.compose.compose_loss`.
"""

from importlib.metadata import version as _version

from composer_core.loss.advantages import group_advantages, overlong_reward_shaping
from composer_core.loss.compose import ComposerBatch, ComposeResult, compose_loss
from composer_core.loss.config import DPO, TAID, ComposeConfig, EntropyOPD, PolicyOptions, SDPOOptions, SimPO
from composer_core.loss.distill import (
    fused_linear_generalized_jsd,
    generalized_jsd,
    sampled_token_distill,
    topk_distill,
)
from composer_core.loss.metrics import (
    ADAPTER_PREFIX,
    GRAD_NORM_KEYS,
    METRIC_KEYS,
    OPTIONAL_METRIC_KEYS,
    Metrics,
)
from composer_core.loss.policy import (
    PolicyLossOutput,
    aggregate_loss,
    clipped_surrogate,
    clipped_surrogate_from_ratio,
    dppo_loss,
    dppo_mask,
    kl_penalty,
    policy_loss,
    rollout_correction_weights,
)
from composer_core.loss.preference import dpo_loss, simpo_loss
from composer_core.loss.wrappers import TAIDScheduler, entropy_opd_loss, taid_loss

__version__ = _version("composer-core")

__all__ = [
    "ADAPTER_PREFIX",
    "DPO",
    "GRAD_NORM_KEYS",
    "METRIC_KEYS",
    "OPTIONAL_METRIC_KEYS",
    "TAID",
    "ComposeConfig",
    "ComposeResult",
    "ComposerBatch",
    "EntropyOPD",
    "Metrics",
    "PolicyLossOutput",
    "PolicyOptions",
    "SDPOOptions",
    "SimPO",
    "TAIDScheduler",
    "__version__",
    "aggregate_loss",
    "clipped_surrogate",
    "clipped_surrogate_from_ratio",
    "compose_loss",
    "dpo_loss",
    "dppo_loss",
    "dppo_mask",
    "entropy_opd_loss",
    "fused_linear_generalized_jsd",
    "generalized_jsd",
    "group_advantages",
    "kl_penalty",
    "overlong_reward_shaping",
    "policy_loss",
    "rollout_correction_weights",
    "sampled_token_distill",
    "simpo_loss",
    "taid_loss",
    "topk_distill",
]
