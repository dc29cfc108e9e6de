"""Group-relative advantages (GRPO / Dr. GRPO) and DAPO overlong reward shaping.

GRPO (Shao et al., DeepSeekMath, arXiv 2402.03300) scores each completion against the other completions of
the same prompt: ``A_i = (r_i − mean_g r) / (std_g r + ε)``. Dr. GRPO (Liu et al., arXiv 2503.20783) drops the
std: ``A_i = r_i − mean_g r``. DAPO (Yu et al., arXiv 2503.14476) adds a soft length penalty to the reward.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import torch
from torch import Tensor

from composer_core.loss.validation import check_choice, check_float, check_int, check_number, check_tensor

__all__ = ["group_advantages", "overlong_reward_shaping"]


def _group_index(
    n: int, group_size: int | None, group_ids: Sequence[Hashable] | Tensor | None, device: torch.device
) -> Tensor:
    """Return an int64 [B] tensor mapping every sample to a dense group index."""
    if group_size is not None and group_ids is not None:
        raise ValueError("pass `group_size` (contiguous groups) or `group_ids` (arbitrary ids), not both.")
    if group_size is None and group_ids is None:
        raise ValueError(
            "`group_size` or `group_ids` is required: pass group_size=G when each prompt's G completions are "
            "contiguous, or group_ids=[prompt id per sample] (e.g. verl's uid)."
        )
    if group_size is not None:
        check_int("group_size", group_size, low=1)
        if n % group_size != 0:
            raise ValueError(
                f"`rewards` has {n} entries, not a multiple of `group_size`={group_size}; pad the batch to whole "
                "groups or pass `group_ids`."
            )
        return torch.arange(n, device=device) // group_size
    assert group_ids is not None
    keys: list[Hashable] = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    if len(keys) != n:
        raise ValueError(f"`group_ids` has {len(keys)} entries but `rewards` has {n}; give one id per sample")
    dense: dict[Hashable, int] = {}
    idx = [dense.setdefault(k, len(dense)) for k in keys]
    return torch.tensor(idx, dtype=torch.long, device=device)


def group_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    *,
    group_ids: Sequence[Hashable] | Tensor | None = None,
    scale: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-4,
    singleton: Literal["zero", "reward"] = "zero",
) -> Tensor:
    """Group-relative advantages ``A_i = (r_i − mean_g r) / (std + eps)`` [B].

    GRPO (arXiv 2402.03300); ``scale="none"`` is Dr. GRPO (arXiv 2503.20783): ``A_i = r_i − mean_g r``.

    Args:
        rewards: [B] scalar reward per completion.
        group_size: G, when each prompt's completions are contiguous (TRL layout).
        group_ids: one hashable id per sample (verl ``uid``); groups may be interleaved.
        scale: ``"group"``: unbiased (Bessel) std within the group (TRL ``scale_rewards="group"``, verl);
            ``"batch"``: unbiased std of the whole batch (TRL ``scale_rewards="batch"``); ``"none"``: no scaling.
        eps: added to the std (TRL 1e-4, verl 1e-6).
        singleton: groups of size 1: ``"zero"`` gives A=0 (TRL); ``"reward"`` gives A=r (verl: mean 0, std 1).

    A zero-std group (all rewards equal) gets A=0 exactly. Returns a new [B] tensor (no gradient).
    """
    check_float("rewards", rewards, ndim=1)
    check_choice("scale", scale, ("group", "batch", "none"))
    check_choice("singleton", singleton, ("zero", "reward"))
    check_number("eps", eps, low=0.0)
    r = rewards.detach()
    n = r.shape[0]
    if n == 0:
        raise ValueError("`rewards` is empty; pass at least one completion's reward.")
    gidx = _group_index(n, group_size, group_ids, r.device)
    n_groups = int(gidx.max()) + 1
    counts = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, gidx, torch.ones_like(r))
    if group_size is not None:
        # contiguous groups: the same reductions as TRL 1.16 (view + nanmean / Bessel-corrected nanstd)
        grouped = r.view(-1, group_size)
        mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
        std_g = _bessel_std(grouped, dim=1).repeat_interleave(group_size)
    else:
        sums = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, gidx, r)
        mean = (sums / counts)[gidx]
        dev = r - mean
        sq = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, gidx, dev * dev)
        std_g = torch.sqrt(sq / (counts - 1).clamp(min=1))[gidx]
    centered = r - mean
    if scale == "group":
        adv = centered / (std_g + eps)
    elif scale == "batch":
        std_b = _bessel_std(r, dim=0) if n > 1 else torch.zeros((), dtype=r.dtype, device=r.device)
        adv = centered / (std_b + eps)
    else:
        adv = centered
    gmax = r.new_zeros(n_groups).scatter_reduce(0, gidx, r, reduce="amax", include_self=False)
    gmin = r.new_zeros(n_groups).scatter_reduce(0, gidx, r, reduce="amin", include_self=False)
    adv = torch.where((gmax == gmin)[gidx], torch.zeros_like(adv), adv)
    single = counts[gidx] == 1
    if bool(single.any()):
        adv = torch.where(single, r if singleton == "reward" else torch.zeros_like(r), adv)
    return adv


def _bessel_std(x: Tensor, dim: int) -> Tensor:
    """Unbiased std along ``dim``: sqrt(mean((x − mean)²) · n/(n−1)) (TRL's ``nanstd`` op sequence)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    variance = variance * (count / (count - 1).clamp(min=1))
    return torch.sqrt(variance).squeeze(dim)


def overlong_reward_shaping(
    lengths: Tensor, max_length: int, cache_length: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476, eq. 13), added to the task reward [B].

    ``R(|y|) = 0`` if ``|y| ≤ L_max − L_cache``; ``((L_max − L_cache) − |y|) / L_cache`` if
    ``L_max − L_cache < |y| ≤ L_max``; ``−1`` if ``|y| > L_max``; all multiplied by ``penalty_factor``
    (verl ``overlong_penalty_factor``).
    """
    check_tensor("lengths", lengths, ndim=1)
    length = lengths.float()
    if not bool(torch.isfinite(length).all()) or bool((length < 0).any()):
        raise ValueError("`lengths` must hold finite, non-negative completion lengths (token counts).")
    if not isinstance(max_length, int) or not isinstance(cache_length, int):
        raise ValueError("`max_length` and `cache_length` must be ints (token counts).")
    if cache_length < 1 or cache_length > max_length:
        raise ValueError(
            f"`cache_length`={cache_length} must satisfy 1 <= cache_length <= max_length={max_length}."
        )
    check_number("penalty_factor", penalty_factor, low=0.0)
    soft_start = max_length - cache_length
    ramp = (soft_start - length) / cache_length
    out = torch.where(length <= soft_start, torch.zeros_like(length), ramp)
    out = torch.where(length > max_length, torch.full_like(length, -1.0), out)
    return out * penalty_factor
