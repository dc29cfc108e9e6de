"""grpo_composer == verl's grpo through verl's own multi-trajectory path (v1 trainer, multi-output agent loops).

verl's v1 trainer computes advantages with ``compute_advantage_for_multi_trajectories(data, batch_keys, ...)``
(row keys ``{uid}_{session}_{output}``). For ``grpo`` only each session's final output joins its uid's group
and the session's advantage is broadcast to all its outputs. These tests call that function, on real
``DataProto`` batches, once with ``grpo`` and once with ``grpo_composer``.
"""

from __future__ import annotations

import inspect
import math

import composer_verl.plugin  # noqa: F401
import numpy as np
import pytest
import torch
from composer_verl.advantage import MULTI_TRAJECTORY_FN, session_members
from composer_verl.config import configure
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

L = 5


def _batch(keys: list[str], rewards: list[float], lengths: list[int]) -> DataProto:
    mask = torch.zeros(len(keys), L)
    token_rewards = torch.zeros(len(keys), L)
    for i, (r, n) in enumerate(zip(rewards, lengths, strict=True)):
        mask[i, :n] = 1
        token_rewards[i, n - 1] = r
    uids = np.array([k.split("_")[0] for k in keys], dtype=object)
    return DataProto.from_dict(
        tensors={"token_level_rewards": token_rewards, "response_mask": mask}, non_tensors={"uid": uids}
    )


def _multi(
    estimator: str, keys: list[str], rewards: list[float], lengths: list[int], norm: bool = True
) -> torch.Tensor:
    """Per-row advantage through verl's v1 function, as ``PPOTrainer._compute_advantage`` calls it."""
    data = compute_advantage_for_multi_trajectories(
        _batch(keys, rewards, lengths),
        batch_keys=keys,
        adv_estimator=estimator,
        num_repeat=4,
        norm_adv_by_std_in_grpo=norm,
        config=AlgoConfig(norm_adv_by_std_in_grpo=norm),
    )
    adv, mask = data.batch["advantages"], data.batch["response_mask"]
    assert torch.equal(adv, data.batch["returns"])
    assert torch.all(adv[mask == 0] == 0)
    for i, n in enumerate(lengths):
        assert torch.all(adv[i, :n] == adv[i, 0])  # one value per row, over its response only
    return adv[:, 0]


ISSUE_KEYS = ["u_0_0", "u_0_1", "u_1_0", "u_2_0"]
ISSUE_REWARDS = [0.0, 1.0, 0.0, 1.0]


def test_issue_example_grpo_composer_equals_grpo() -> None:
    """One uid; session 0 returns two outputs. Members are s0_1 (1), s1_0 (0), s2_0 (1):
    mean 2/3, unbiased std 1/√3, so A = ±(1/3)·√3 = 0.577 / −(2/3)·√3 = −1.155, s0_0 gets s0's A."""
    lengths = [3, 4, 2, 5]
    grpo = _multi("grpo", ISSUE_KEYS, ISSUE_REWARDS, lengths)
    ours = _multi("grpo_composer", ISSUE_KEYS, ISSUE_REWARDS, lengths)
    s = 1 / math.sqrt(3) + 1e-6
    expected = torch.tensor([1 / 3 / s, 1 / 3 / s, -2 / 3 / s, 1 / 3 / s])
    torch.testing.assert_close(grpo, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, grpo, rtol=0, atol=1e-6)
    assert [round(x, 3) for x in ours.tolist()] == [0.577, 0.577, -1.155, 0.577]


# uid "a": 4 sessions, session 1 has 3 outputs listed out of order, session 3 has 2 non-adjacent outputs
# uid "b": 2 sessions with one output each; uid "c": one session with 2 outputs (a size-1 group);
# uid "d": 3 sessions, equal final rewards (zero std) but different non-final rewards.
MIXED_KEYS = [
    "a_0_0", "b_0_0", "a_1_2", "a_1_0", "c_0_0", "a_3_0", "d_0_0", "a_1_1",
    "b_1_0", "a_2_0", "c_0_1", "d_1_0", "a_3_1", "d_2_1", "d_2_0",
]  # fmt: skip
MIXED_REWARDS = [1.0, 0.5, 0.0, 1.0, 3.0, 5.0, 2.0, 1.0, 1.5, 1.0, -1.0, 2.0, 0.0, 2.0, -4.0]
MIXED_LENGTHS = [3, 5, 1, 2, 4, 5, 3, 2, 1, 4, 2, 3, 5, 1, 2]


@pytest.mark.parametrize("norm", [True, False])
def test_mixed_sessions_out_of_order_equal_grpo(norm: bool) -> None:
    grpo = _multi("grpo", MIXED_KEYS, MIXED_REWARDS, MIXED_LENGTHS, norm)
    ours = _multi("grpo_composer", MIXED_KEYS, MIXED_REWARDS, MIXED_LENGTHS, norm)
    # verl scales a size-1 group (uid "c") by 1/(1+eps), composer gives exactly r (documented): rtol 2e-6
    torch.testing.assert_close(ours, grpo, rtol=2e-6, atol=1e-6)
    # closed form for uid "a": members a_0_0 (1), a_1_2 (0), a_2_0 (1), a_3_1 (0) -> mean 0.5, std 1/√3
    a = {k: v for k, v in zip(MIXED_KEYS, ours.tolist(), strict=True) if k.startswith("a_")}
    scale = (1 / math.sqrt(3) + 1e-6) if norm else 1.0
    for key, want in {"a_0_0": 0.5, "a_1_0": -0.5, "a_1_1": -0.5, "a_1_2": -0.5, "a_3_0": -0.5}.items():
        assert math.isclose(a[key], want / scale, rel_tol=1e-6), key
    assert ours[MIXED_KEYS.index("c_0_0")].item() == -1.0  # size-1 group: A = r of the final output
    d = [ours[MIXED_KEYS.index(k)].item() for k in ("d_0_0", "d_1_0", "d_2_0", "d_2_1")]
    assert d == [0.0, 0.0, 0.0, 0.0]  # zero-std group, whatever the non-final outputs scored


@pytest.mark.parametrize("norm", [True, False])
def test_single_output_sessions_equal_grpo_and_the_plain_estimator(norm: bool) -> None:
    keys = [f"{u}_{s}_0" for s in range(4) for u in ("p", "q", "r")]  # interleaved uids
    rewards = [float((i * 7) % 5) for i in range(len(keys))]
    lengths = [1 + (i * 3) % L for i in range(len(keys))]
    grpo = _multi("grpo", keys, rewards, lengths, norm)
    ours = _multi("grpo_composer", keys, rewards, lengths, norm)
    torch.testing.assert_close(ours, grpo, rtol=0, atol=1e-6)
    # single output per session: the multi-trajectory path is the per-row estimator
    from verl.trainer.ppo.ray_trainer import compute_advantage

    plain = compute_advantage(
        _batch(keys, rewards, lengths),
        adv_estimator="grpo_composer",
        config=AlgoConfig(norm_adv_by_std_in_grpo=norm),
    ).batch["advantages"][:, 0]
    assert torch.equal(ours, plain)


def test_batch_scale_uses_the_session_members() -> None:
    configure({"adv_scale": "batch"})
    ours = _multi("grpo_composer", ISSUE_KEYS, ISSUE_REWARDS, [2, 2, 2, 2])
    std = torch.tensor([1.0, 0.0, 1.0]).std().item()  # the three final outputs
    want = [1 / 3 / (std + 1e-6), 1 / 3 / (std + 1e-6), -2 / 3 / (std + 1e-6), 1 / 3 / (std + 1e-6)]
    torch.testing.assert_close(ours, torch.tensor(want), rtol=1e-6, atol=0)


def test_without_the_v1_path_every_row_is_a_member() -> None:
    members, row_member = session_members(None, 3)
    assert members.tolist() == row_member.tolist() == [0, 1, 2]
    members, row_member = session_members(["x_0_1", "x_0_0", "x_1_0"], 3)
    assert members.tolist() == [0, 2] and row_member.tolist() == [0, 0, 1]


@pytest.mark.parametrize(("keys", "match"), [(["u_0_0", "u-0-0"], "not \\{uid\\}"), (["u_0_0"], "2 rows")])
def test_bad_batch_keys_name_the_problem(keys: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        session_members(keys, 2)


def test_verl_v1_trainer_still_calls_the_multi_trajectory_path_with_batch_keys() -> None:
    """grpo_composer reads `batch_keys` from this call; a verl upgrade that changes it must fail here."""
    assert "batch_keys" in inspect.signature(compute_advantage_for_multi_trajectories).parameters
    assert compute_advantage_for_multi_trajectories.__name__ == MULTI_TRAJECTORY_FN
    source = inspect.getsource(PPOTrainer._compute_advantage)
    assert f"{MULTI_TRAJECTORY_FN}(" in source and "batch_keys=batch.keys" in source
