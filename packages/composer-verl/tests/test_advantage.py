"""grpo_composer through verl's own compute_advantage on a real DataProto."""

from __future__ import annotations

import math

import composer_verl.plugin  # noqa: F401  (the entry point already ran on `import verl`; explicit for clarity)
import numpy as np
import pytest
import torch
from composer_verl.config import configure
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.ray_trainer import compute_advantage

# Interleaved groups (verl uids need not be contiguous):
#   "a": rewards 1, 0, 0, 0  -> mean 0.25, unbiased std 0.5
#   "b": a single completion with reward 1 (size-1 group)
#   "c": rewards 2, 2 (zero std)
UIDS = np.array(["a", "b", "a", "c", "a", "c", "a"], dtype=object)
REWARDS = [1.0, 1.0, 0.0, 2.0, 0.0, 2.0, 0.0]
LENGTHS = [3, 2, 4, 1, 4, 2, 3]
L = 4


def _batch() -> DataProto:
    mask = torch.zeros(len(REWARDS), L)
    rewards = torch.zeros(len(REWARDS), L)
    for i, (r, n) in enumerate(zip(REWARDS, LENGTHS)):
        mask[i, :n] = 1
        rewards[i, n - 1] = r  # outcome reward on the last response token, as verl's reward managers do
    return DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask}, non_tensors={"uid": UIDS.copy()}
    )


def _adv(algo: AlgoConfig | None = None, estimator: str = "grpo_composer") -> torch.Tensor:
    data = compute_advantage(_batch(), adv_estimator=estimator, config=algo or AlgoConfig())
    adv = data.batch["advantages"]
    mask = data.batch["response_mask"]
    assert torch.equal(adv, data.batch["returns"])
    assert torch.all(adv[mask == 0] == 0)  # broadcast over the response only
    for i in range(adv.shape[0]):  # one value per row
        assert torch.all(adv[i, : LENGTHS[i]] == adv[i, 0])
    return adv[:, 0]


def test_grpo_group_values_including_size_one_and_zero_std() -> None:
    a = 0.5 + 1e-6
    expected = torch.tensor([0.75 / a, 1.0, -0.25 / a, 0.0, -0.25 / a, 0.0, -0.25 / a])
    torch.testing.assert_close(_adv(), expected, rtol=0, atol=1e-6)


def test_matches_verl_grpo_except_documented_singleton_scale() -> None:
    ours, verl = _adv(), _adv(estimator="grpo")
    multi = torch.tensor([u != "b" for u in UIDS])
    torch.testing.assert_close(ours[multi], verl[multi], rtol=0, atol=1e-6)
    # verl's size-1 group: (r - 0) / (1 + eps); composer gives exactly r.
    assert ours[1].item() == 1.0
    assert math.isclose(verl[1].item(), 1.0 / (1 + 1e-6), rel_tol=1e-6)


def test_dr_grpo_follows_norm_adv_by_std_in_grpo() -> None:
    adv = _adv(AlgoConfig(norm_adv_by_std_in_grpo=False))
    torch.testing.assert_close(
        adv, torch.tensor([0.75, 1.0, -0.25, 0.0, -0.25, 0.0, -0.25]), rtol=0, atol=1e-7
    )


def test_adv_scale_overrides_verl_flag() -> None:
    configure({"adv_scale": "none"})
    torch.testing.assert_close(_adv(AlgoConfig(norm_adv_by_std_in_grpo=True))[0], torch.tensor(0.75))


def test_adv_scale_batch_uses_batch_std() -> None:
    configure({"adv_scale": "batch"})
    std = torch.tensor(REWARDS).std().item()
    adv = _adv()
    assert math.isclose(adv[0].item(), 0.75 / (std + 1e-6), rel_tol=1e-6)
    assert adv[3].item() == 0.0 and adv[1].item() == 1.0


def test_adv_singleton_zero() -> None:
    configure({"adv_singleton": "zero"})
    assert _adv()[1].item() == 0.0


def test_adv_eps() -> None:
    configure({"adv_eps": 0.5})
    assert math.isclose(_adv()[0].item(), 0.75 / (0.5 + 0.5), rel_tol=1e-6)


def test_the_section_reaches_the_estimator() -> None:
    configure({"adv_singleton": "zero", "adv_scale": "none"})
    adv = _adv()
    assert adv[1].item() == 0.0 and math.isclose(adv[0].item(), 0.75, rel_tol=1e-6)


def test_missing_uid_is_a_clear_error() -> None:
    data = _batch()
    data.non_tensor_batch.pop("uid")
    with pytest.raises(ValueError, match="uid"):
        compute_advantage(data, adv_estimator="grpo_composer", config=AlgoConfig())


def test_non_finite_reward_is_rejected() -> None:
    data = _batch()
    data.batch["token_level_rewards"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="rewards"):
        compute_advantage(data, adv_estimator="grpo_composer", config=AlgoConfig())
