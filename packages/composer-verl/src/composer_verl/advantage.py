"""The ``grpo_composer`` advantage estimator (registered in verl's ``ADV_ESTIMATOR_REGISTRY``).

Outcome-reward GRPO / Dr. GRPO group advantages computed by ``composer_core.loss.advantages``:

    r_i = Σ_t token_level_rewards[i, t]
    A_i = (r_i - mean_g r) / (std_g r + ε)      scale="group"  (GRPO, DeepSeekMath arXiv 2402.03300)
    A_i = (r_i - mean_g r) / (std_batch r + ε)  scale="batch"  (TRL scale_rewards="batch")
    A_i =  r_i - mean_g r                       scale="none"   (Dr. GRPO, arXiv 2503.20783)

g is the group of rows sharing verl's ``uid`` (``index``), std is unbiased (Bessel). A group of
size 1 has no baseline: ``adv_singleton="reward"`` gives ``A = r`` (verl's convention of mean 0 and
std 1, exactly r rather than verl's ``r/(1+ε)``), ``"zero"`` gives ``A = 0`` (TRL). A zero-std group
gives 0. The advantage is broadcast over the response: ``advantages = A[:, None] * response_mask``,
and ``returns`` equals ``advantages`` (as verl's GRPO does).

Options come from :mod:`composer_verl.config` (``adv_scale``, ``adv_eps``, ``adv_singleton``); with
``adv_scale`` unset, verl's own ``algorithm.norm_adv_by_std_in_grpo`` chooses group vs none.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from composer_verl.config import ComposerVerlConfig, current_config

ESTIMATOR_NAME = "grpo_composer"


def resolve_scale(composer: ComposerVerlConfig, algo_config: Any) -> str:
    """``composer.adv_scale`` if set, else verl's ``norm_adv_by_std_in_grpo`` (default True)."""
    if composer.adv_scale is not None:
        return composer.adv_scale
    norm = True if algo_config is None else algo_config.get("norm_adv_by_std_in_grpo", True)
    return "group" if norm else "none"


def compute_grpo_composer_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl advantage-estimator contract: ``(advantages, returns)``, both ``(bs, response_length)``.

    Args:
        token_level_rewards: ``(bs, L)`` rewards; the outcome reward of a row is their sum.
        response_mask: ``(bs, L)`` 0/1 mask of response tokens.
        index: ``(bs,)`` group ids (verl's ``non_tensor_batch["uid"]``); required.
        config: verl's ``AlgoConfig`` (reads ``norm_adv_by_std_in_grpo``).
    """
    from composer_core.loss.advantages import group_advantages

    if index is None:
        raise ValueError(
            "grpo_composer needs group ids: verl passes them as `index` from non_tensor_batch['uid']; "
            "make sure the batch has a 'uid' entry (verl's rollout adds one per prompt)."
        )
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be (bs, response_length)."
        )
    if len(index) != token_level_rewards.shape[0]:
        raise ValueError(f"index has {len(index)} entries for {token_level_rewards.shape[0]} rows.")
    composer = current_config()
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        adv = group_advantages(
            scores,
            group_ids=list(index),
            scale=resolve_scale(composer, config),  # type: ignore[arg-type]
            eps=composer.adv_eps,
            singleton=composer.adv_singleton,
        )
    adv = adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask
    return adv, adv
