"""The ``grpo_composer`` advantage estimator (registered in verl's ``ADV_ESTIMATOR_REGISTRY``).

Outcome-reward GRPO / Dr. GRPO group advantages computed by ``composer_core.loss.advantages``:

    r_i = Σ_t token_level_rewards[i, t]
    A_i = (r_i - mean_g r) / (std_g r + ε)      scale="group"  (GRPO, DeepSeekMath arXiv 2402.03300)
    A_i = (r_i - mean_g r) / (std_batch r + ε)  scale="batch"  (TRL scale_rewards="batch")
    A_i =  r_i - mean_g r                       scale="none"   (Dr. GRPO, arXiv 2503.20783)

g is the group of rows sharing verl's ``uid`` (``index``), std is unbiased (Bessel). A group of size 1 gets
``A = r`` (``adv_singleton="reward"``, verl's mean 0 / std 1) or ``A = 0`` (``"zero"``, TRL); a zero-std group
gives 0. ``advantages = A[:, None] * response_mask`` and ``returns`` equals it (as verl's GRPO). Options come from
:mod:`composer_verl.config`; with ``adv_scale`` unset, verl's ``algorithm.norm_adv_by_std_in_grpo`` chooses.

Multi-output agent sessions (verl's v1 trainer): like verl's ``grpo``, one group member per session (its final
output), the session's advantage broadcast to all its outputs (:func:`enclosing_batch_keys`,
:func:`session_members`; README, "Multi-output agent loops").
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from composer_verl.config import current_config

ESTIMATOR_NAME = "grpo_composer"
MULTI_TRAJECTORY_MODULE = "verl.trainer.ppo.v1.utils"
MULTI_TRAJECTORY_FN = "compute_advantage_for_multi_trajectories"


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
    scale = composer.adv_scale  # unset: verl's norm_adv_by_std_in_grpo (default True) chooses group or none
    if scale is None:
        scale = "group" if config is None or config.get("norm_adv_by_std_in_grpo", True) else "none"
    scores = token_level_rewards.sum(dim=-1)
    members, row_member = session_members(enclosing_batch_keys(), len(index), scores.device)
    with torch.no_grad():
        adv = group_advantages(
            scores[members],
            group_ids=[index[i] for i in members.tolist()],
            scale=scale,
            eps=composer.adv_eps,
            singleton=composer.adv_singleton,
        )[row_member]
    adv = adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask
    return adv, adv


def enclosing_batch_keys() -> Sequence[str] | None:
    """``batch_keys`` of the enclosing verl ``compute_advantage_for_multi_trajectories`` call, or ``None``.

    verl's v1 trainer passes its row keys (``{uid}_{session}_{output}``) only to that function, which
    calls the registered estimator through ``compute_advantage`` with ``index=uid`` alone.
    """
    module = sys.modules.get(MULTI_TRAJECTORY_MODULE)
    code = getattr(getattr(module, MULTI_TRAJECTORY_FN, None), "__code__", None)
    if code is None:
        return None
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return None
    keys = frame.f_locals.get("batch_keys")
    if keys is None:
        raise RuntimeError(
            f"grpo_composer was called by verl's {MULTI_TRAJECTORY_FN} but found no `batch_keys` argument "
            "there: this verl version changed that function; install the verl version composer-verl "
            "declares (pip install composer-verl) or use algorithm.adv_estimator=grpo."
        )
    return list(keys)


def session_members(
    keys: Sequence[str] | None, rows: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(members, row_member)``: the rows that form the groups, and for every row its member's position.

    With ``keys`` (``{uid}_{session}_{output}``, one per row) a session's member is its final output
    (highest ``output``; verl's rule); without keys every row is its own member.
    """
    if keys is None:
        everyone = torch.arange(rows, device=device)
        return everyone, everyone
    if len(keys) != rows:
        raise ValueError(
            f"verl passed {len(keys)} batch keys for {rows} rows; they must correspond one to one."
        )
    final: dict[str, tuple[int, int]] = {}  # session -> (output index, row)
    sessions: list[str] = []
    for row, key in enumerate(keys):
        session, sep, output = str(key).rpartition("_")
        if not sep or not session or not output.isdigit():
            raise ValueError(
                f"batch key {key!r} is not {{uid}}_{{session}}_{{output}} (verl's v1 agent-loop key format)."
            )
        sessions.append(session)
        if session not in final or final[session][0] < int(output):
            final[session] = (int(output), row)
    position = {session: i for i, session in enumerate(final)}
    members = torch.tensor([row for _, row in final.values()], dtype=torch.long, device=device)
    row_member = torch.tensor([position[s] for s in sessions], dtype=torch.long, device=device)
    return members, row_member
