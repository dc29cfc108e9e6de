"""Channel 3's on-policy pairs (``replay_pairs='on_policy'``) and the per-channel gradient norms.

On-policy pairs: each failed completion of a group (reward < ``success_reward_threshold``, chosen by
:func:`composer_core.traces.onpolicy.failed_rows`) is the rejected side of one pair whose chosen side is the row's
``chosen`` column. The pair sits on the completion's own row, so the rejected side's summed log-probs are read from
the policy forward that already scored it (no second forward); only the chosen rows join that forward.

Gradient norms: on the micro-batches of a step that TRL logs, ``torch.autograd.grad`` of each weighted channel term
(``policy``, ``alpha_sdpo·sdpo``, ``beta_replay·replay``) w.r.t. the trainable parameters, ``retain_graph=True``:
one extra backward per channel on logging steps and one gradient-sized float32 buffer per channel while the step
accumulates; the parameters' ``.grad`` and so the update are untouched. The norm is taken of the gradient summed
over the accumulation window and averaged over processes (as DDP averages), i.e. each channel's part of the
gradient TRL clips and logs as ``grad_norm``.
"""

from __future__ import annotations

from typing import Any

import torch
from composer_core.loss.metrics import ADAPTER_PREFIX
from composer_core.traces.onpolicy import failed_rows
from torch import Tensor

PairRow = tuple[list[int], list[int], list[int], list[int], list[int], list[int]]
"""(chosen ids, chosen mask, chosen attention, rejected ids, rejected mask, rejected attention)"""


def on_policy_rows(
    trainer: Any, inputs: list[dict[str, Any]], output: dict[str, Any], mode: str
) -> tuple[list[PairRow | None], list[bool]]:
    """One pair per failed completion of this process's rows: (pair rows, None where no pair; has_pair)."""
    a = trainer.args
    offset = trainer.accelerator.process_index * len(inputs)
    failed = set(failed_rows(trainer._group_rewards(), trainer._group_size(mode), a.success_reward_threshold))
    ids, attn = output["completion_ids"], output["completion_mask"]
    scored = attn if "tool_mask" not in output else attn * output["tool_mask"]
    rows: list[PairRow | None] = []
    for i, x in enumerate(inputs):
        if offset + i not in failed or not bool(scored[i].any()):
            rows.append(None)
            continue
        if x.get("chosen") is None:
            raise ValueError(
                "replay_pairs='on_policy' needs the `chosen` column (a teacher's answer) in every row of a "
                "failed completion; fill it or use replay_pairs='columns'."
            )
        ci, cm = trainer._pair_ids(x["chosen"], x.get("chosen_mask"), "chosen")
        rows.append((ci, cm, [1] * len(ci), ids[i].tolist(), scored[i].tolist(), attn[i].tolist()))
    return rows, [r is not None for r in rows]


class ChannelGradNorms:
    """Each channel's gradient summed over a logged step's micro-batches (module docstring)."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}

    def add(self, model: torch.nn.Module, terms: dict[str, Tensor | None]) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        for name, term in terms.items():
            flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
            if term is not None and term.requires_grad:
                grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
                flat = torch.cat(
                    [
                        flat.new_zeros(p.numel()) if g is None else g.reshape(-1).float()
                        for p, g in zip(params, grads)
                    ]
                )
            self.sums[name] = flat if name not in self.sums else self.sums[name] + flat

    def log(self, trainer: Any) -> None:
        """Append each channel's norm to TRL's metrics (the window's sum, averaged over processes) and reset."""
        for name, flat in self.sums.items():
            if trainer.accelerator.num_processes > 1:
                flat = trainer.accelerator.reduce(flat, reduction="mean")
            trainer._metrics["train"][f"{ADAPTER_PREFIX}grad_norm/{name}"].append(float(flat.norm()))
        self.sums.clear()


def logs_this_step(trainer: Any) -> bool:
    """Whether the optimiser step now accumulating is one TRL logs (``logging_strategy='steps'``)."""
    a, step = trainer.args, trainer.state.global_step + 1
    every = trainer.state.logging_steps or a.logging_steps
    return a.logging_strategy == "steps" and (
        step % int(every) == 0 or (step == 1 and bool(a.logging_first_step))
    )
