"""Loss demo: compute all three composer channels on a toy batch and print them.

``python -m composer_core.loss.demo``. A toy "model" (an embedding + LM head over a 32-token
vocabulary) produces student logits for 2 prompts × 4 completions; the hinted self-teacher is the same model
with a hint vector added to its hidden state; two trace-replay pairs come from the same model. Prints each
channel, the total, and the gradient norm of the model parameters after ``total.backward()``.
"""

from __future__ import annotations

import argparse

import torch

from composer_core.loss.advantages import group_advantages
from composer_core.loss.compose import ComposerBatch, compose_loss
from composer_core.loss.config import option_help

# the demo's preset: channels 2 and 3 on (core's ComposeConfig defaults are 0, i.e. off)
PRESET = {"alpha_sdpo": 1.0, "beta_replay": 0.5}


def build_batch(seed: int = 0) -> tuple[ComposerBatch, list[torch.nn.Parameter]]:
    """A reproducible toy batch with all three channels; returns (batch, parameters with grad)."""
    g = torch.Generator().manual_seed(seed)
    vocab, hidden, groups, group_size, length = 32, 16, 2, 4, 6
    b = groups * group_size
    embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) * 0.5)
    head = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) * 0.5)
    hint = torch.randn(hidden, generator=g)
    tokens = torch.randint(0, vocab, (b, length), generator=g)
    h = embed[tokens]  # [B, T, H]
    student_logits = h @ head.T
    with torch.no_grad():
        teacher_logits = (h + hint) @ head.T
    logprobs = torch.log_softmax(student_logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[1, 4:] = False  # a shorter completion
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    chosen = logprobs[[0, 3]].sum(-1)
    rejected = logprobs[[1, 2]].sum(-1)
    batch = ComposerBatch(
        logprobs=logprobs,
        advantages=group_advantages(rewards, group_size),
        completion_mask=mask,
        student_logits=student_logits,
        teacher_logits=teacher_logits,
        sdpo_mask=mask,
        chosen_logps=chosen,
        rejected_logps=rejected,
        ref_chosen_logps=chosen.detach() - 0.1,
        ref_rejected_logps=rejected.detach() + 0.1,
    )
    return batch, [embed, head]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    for name, value in PRESET.items():
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=value, help=option_help(name))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    batch, params = build_batch(args.seed)
    result = compose_loss(batch, alpha_sdpo=args.alpha_sdpo, beta_replay=args.beta_replay)
    torch.autograd.backward(result.total)
    grad_norm = torch.stack([(p.grad**2).sum() for p in params if p.grad is not None]).sum().sqrt()
    print("composer loss demo: toy batch of 2 prompts x 4 completions, V=32")
    assert result.policy is not None  # w_policy = 1
    print(f"  policy (GRPO/DAPO)          : {result.policy.item():+.6f}")
    if result.sdpo is not None:
        print(f"  sdpo (JSD beta=0.5)         : {result.sdpo.item():+.6f}  x alpha={args.alpha_sdpo}")
    if result.replay is not None:
        print(f"  replay (DPO sigmoid)        : {result.replay.item():+.6f}  x beta={args.beta_replay}")
    print(f"  total                       : {result.total.item():+.6f}")
    print(f"  grad norm (embed, head)     : {float(grad_norm):.6f}")
    for key in sorted(result.metrics):
        print(f"    {key:<24} {result.metrics[key]:.6g}")


if __name__ == "__main__":
    main()
