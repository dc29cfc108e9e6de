"""composer_loss driving optimisation of a small torch policy the way PRIME-RL's trainer does:
per-token log-probs of packed samples -> one loss call per sample -> sum / rl-token count ->
backward -> optimizer step. Checks that the gradient reaches the parameters and moves them in
the documented direction (a toy model: prime-rl's trainer needs a GPU and is not installable here)."""

from __future__ import annotations

from typing import Any

import torch
from composer_prime_rl import LossInputs, composer_loss

V, H = 12, 16


class TinyPolicy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.head = torch.nn.Linear(H, V)

    def logprobs(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(inputs)))
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]


def _data() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    lengths = [6, 4, 5]
    inputs = torch.randint(0, V, (sum(lengths),), generator=g)
    targets = torch.randint(0, V, (sum(lengths),), generator=g)
    advantages = torch.cat([torch.full((n,), a) for n, a in zip(lengths, [1.0, -1.0, 0.5], strict=True)])
    mask = torch.ones(sum(lengths), dtype=torch.bool)
    mask[0] = mask[6] = mask[10] = False  # one prompt token per sample
    return {"lengths": lengths, "inputs": inputs, "targets": targets, "adv": advantages, "mask": mask}


def _train(
    kwargs: dict[str, Any], steps: int, d: dict[str, Any], ref: torch.Tensor | None = None
) -> TinyPolicy:
    torch.manual_seed(0)
    policy = TinyPolicy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    for _ in range(steps):
        with torch.no_grad():  # the sampler: the current policy (on-policy), as vLLM would report it
            inference = policy.logprobs(d["inputs"], d["targets"])
        packed = policy.logprobs(d["inputs"], d["targets"])
        total, offset = packed.sum() * 0.0, 0
        for n in d["lengths"]:
            part = slice(offset, offset + n)
            sample = LossInputs(
                trainer_logprobs=packed[part],
                inference_logprobs=inference[part],
                ref_logprobs=None if ref is None else ref[part],
                advantages=d["adv"][part],
                loss_mask=d["mask"][part],
            )
            total = total + composer_loss(sample, **kwargs).loss
            offset += n
        opt.zero_grad()
        (total / int(d["mask"].sum())).backward()
        opt.step()
    return policy


def _sample_logprob(policy: TinyPolicy, d: dict[str, Any]) -> list[float]:
    with torch.no_grad():
        lp = policy.logprobs(d["inputs"], d["targets"])
    out, offset = [], 0
    for n in d["lengths"]:
        m = d["mask"][offset : offset + n]
        out.append(float(lp[offset : offset + n][m].sum()))
        offset += n
    return out


def test_policy_gradient_moves_sample_logprobs_by_advantage_sign() -> None:
    d = _data()
    for kwargs in ({}, {"policy_loss": "clipped_surrogate"}):
        torch.manual_seed(0)
        before = _sample_logprob(TinyPolicy(), d)
        policy = _train(kwargs, steps=5, d=d)
        after = _sample_logprob(policy, d)
        assert after[0] > before[0]  # A = +1
        assert after[1] < before[1]  # A = −1
        assert after[2] > before[2]  # A = +0.5


def test_self_distillation_pulls_the_policy_towards_the_hinted_teacher() -> None:
    d = _data()
    g = torch.Generator().manual_seed(1)
    teacher = torch.log_softmax(torch.randn(len(d["inputs"]), V, generator=g) * 2, -1)
    ref = teacher.gather(-1, d["targets"][:, None])[:, 0]
    d["adv"] = torch.zeros_like(d["adv"])  # no credit: only channel 2 can move the policy

    def gap(policy: TinyPolicy) -> float:
        with torch.no_grad():
            lp = policy.logprobs(d["inputs"], d["targets"])
        return float(((lp - ref).abs() * d["mask"]).sum())

    torch.manual_seed(0)
    before = gap(TinyPolicy())
    policy = _train({"alpha_sdpo": 1.0, "kl_tau": 0.0}, steps=30, d=d, ref=ref)
    untouched = _train({"kl_tau": 0.0}, steps=30, d=d, ref=ref)
    assert gap(policy) < 0.7 * before  # sampled-token reverse KL closes the gap to the teacher
    assert gap(untouched) == before  # no credit, no KL term, alpha_sdpo = 0: nothing moves
