"""Channel 3 in ``ComposerGRPOTrainer``: its pairs (the dataset's ``chosen``/``rejected``, or on-policy pairs), their
reference log-probs and their forward.

Column pairs (``replay_pairs='columns'``): once per prompt (its group's first row), text, token ids or assistant
messages, optional ``chosen_mask``/``rejected_mask``; the reference log-probs come from ``ref_chosen_logps`` /
``ref_rejected_logps`` columns or a frozen reference (TRL's ref model, the PEFT base with adapters disabled, or a
frozen copy of the initial policy), computed once per generation batch.

On-policy pairs (``replay_pairs='on_policy'``): each failed completion of a group (reward <
``success_reward_threshold``, chosen by :func:`composer_core.traces.onpolicy.failed_rows`) is the rejected side of
one pair whose chosen side is the row's ``chosen`` column. The pair sits on the completion's own row, so the rejected
side's summed log-probs are read from the policy forward that already scored it (no second forward); only the chosen
rows join that forward (:class:`MergedPairs`).
"""

from __future__ import annotations

import copy
import math
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from accelerate.utils import is_peft_model
from composer_core.loss.compose import ComposerBatch
from composer_core.traces.onpolicy import failed_rows
from torch import Tensor
from trl.trainer.utils import use_adapter

from composer_trl.teacher import K, SDPOTeacher, column

PairRow = tuple[list[int], list[int], list[int], list[int], list[int], list[int]]
"""(chosen ids, chosen mask, chosen attention, rejected ids, rejected mask, rejected attention)"""


class ReplayPairs(SDPOTeacher):
    """The channel-3 layer of :class:`~composer_trl.ComposerGRPOTrainer` (module docstring)."""

    _replay_ref_model: torch.nn.Module | None
    _replay_ref_source: str  # none | column | ref_model | peft_base | frozen_copy
    _pair_token_cache: dict[str, list[int]]  # text action → token ids (datasets repeat them)

    def _setup_replay(self, columns: set[str] | None) -> None:
        """Where a DPO pair's reference log-probs come from (``replay_reference``, the dataset's ``columns``)."""
        a = self.args
        self._replay_ref_model, self._replay_ref_source, self._pair_token_cache = None, "none", {}
        if a.beta_replay == 0 or a.dpo_variant != "dpo":
            return
        has_cols = columns is not None and {"ref_chosen_logps", "ref_rejected_logps"} <= columns
        if a.replay_reference == "column" or (a.replay_reference == "auto" and has_cols):
            if not has_cols:
                raise ValueError(
                    "replay_reference='column' needs `ref_chosen_logps` and `ref_rejected_logps` columns "
                    "(summed reference log-probs); add them or use replay_reference='model'."
                )
            self._replay_ref_source = "column"
        elif self.ref_model is not None:
            self._replay_ref_source = "ref_model"
        elif is_peft_model(self.model):
            self._replay_ref_source = "peft_base"
        else:  # a frozen copy of the initial policy (TRL builds no ref model when beta == 0)
            ref = copy.deepcopy(self.model).eval().requires_grad_(False)
            self._replay_ref_model = self.accelerator.prepare_model(ref, evaluation_mode=True)
            self._replay_ref_source = "frozen_copy"

    # ------------------------------------------------------------------ generation: the pairs

    def _pair_ids(self, value: Any, mask: Any, name: str) -> tuple[list[int], list[int]]:
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return self._pair_ids(_assistant_text(value, name), mask, name)
        if isinstance(value, str):
            if mask is not None:
                raise ValueError(
                    f"`{name}_mask` needs `{name}` as a list of token ids (a mask of text is ambiguous)."
                )
            ids = self._text_ids(value)
            m = [1] * len(ids)
        elif isinstance(value, list) and all(isinstance(t, int) for t in value):
            ids = list(value)
            m = [1] * len(ids) if mask is None else [int(bool(v)) for v in mask]
        else:
            raise ValueError(
                f"`{name}` must be text, a list of token ids or assistant messages, got {value!r:.80}."
            )
        if len(m) != len(ids):
            raise ValueError(f"`{name}_mask` has {len(m)} entries for {len(ids)} tokens of `{name}`.")
        limit = self.args.max_replay_length or self.args.max_completion_length
        ids, m = ids[:limit], m[:limit]
        if not any(m):
            raise ValueError(
                f"`{name}` has no scored token (empty or fully masked); fix the row or drop the pair."
            )
        return ids, m

    def _text_ids(self, text: str) -> list[int]:
        """Token ids of a text action (+ EOS per ``replay_append_eos``), tokenised once per distinct text."""
        ids = self._pair_token_cache.get(text)
        if ids is None:
            ids = list(self._tokenizer(text=text, add_special_tokens=False)["input_ids"])
            if self.args.replay_append_eos and self._tokenizer.eos_token_id is not None:
                ids.append(self._tokenizer.eos_token_id)
            if len(self._pair_token_cache) >= 100_000:
                self._pair_token_cache.clear()
            self._pair_token_cache[text] = ids
        return list(ids)

    def _column_rows(self, inputs: list[dict[str, Any]], mode: str) -> list[PairRow | None]:
        """``replay_pairs='columns'``: the dataset's chosen/rejected, once per prompt (its group's first row)."""
        g, offset = self._group_size(mode), self.accelerator.process_index * len(inputs)
        rows: list[PairRow | None] = []
        for i, x in enumerate(inputs):
            # Each prompt appears num_generations times in a generation batch: keep its pair once.
            if x.get("chosen") is None or x.get("rejected") is None or (offset + i) % g != 0:
                rows.append(None)
                continue
            ci, cm = self._pair_ids(x["chosen"], x.get("chosen_mask"), "chosen")
            ri, rm = self._pair_ids(x["rejected"], x.get("rejected_mask"), "rejected")
            rows.append((ci, cm, [1] * len(ci), ri, rm, [1] * len(ri)))
        return rows

    def _on_policy_rows(
        self, inputs: list[dict[str, Any]], output: dict[str, Any], mode: str
    ) -> list[PairRow | None]:
        """One pair per failed completion of this process's rows (None where no pair)."""
        offset = self.accelerator.process_index * len(inputs)
        threshold = vars(self.args)["success_reward_threshold"]  # a field added from TeacherContextOptions
        failed = set(failed_rows(self._group_rewards(), self._group_size(mode), threshold))
        ids, attn = output["completion_ids"], output["completion_mask"]
        scored = attn * output.get("tool_mask", 1)
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
            ci, cm = self._pair_ids(x["chosen"], x.get("chosen_mask"), "chosen")
            rows.append((ci, cm, [1] * len(ci), ids[i].tolist(), scored[i].tolist(), attn[i].tolist()))
        return rows

    def _build_pairs(self, inputs: list[dict[str, Any]], output: dict[str, Any], mode: str) -> dict[str, Any]:
        device, pad_id = self.accelerator.device, self._tokenizer.pad_token_id
        on_policy = self.args.replay_pairs == "on_policy"
        found = self._on_policy_rows(inputs, output, mode) if on_policy else self._column_rows(inputs, mode)
        has_pair = [r is not None for r in found]
        empty: PairRow = ([pad_id], [0], [0], [pad_id], [0], [0])
        columns = [list(col) for col in zip(*(empty if r is None else r for r in found))]
        width = max(len(t) for t in columns[0] + columns[3])
        names = ("chosen_ids", "chosen_mask", "chosen_attn", "rejected_ids", "rejected_mask", "rejected_attn")
        out: dict[str, Any] = {
            f"{K}{name}": torch.tensor(
                [r + [pad_id if "ids" in name else 0] * (width - len(r)) for r in col], device=device
            )
            for name, col in zip(names, columns)
        }
        out[f"{K}has_pair"] = torch.tensor(has_pair, device=device)
        out[f"{K}replay_num_items"] = self.accelerator.gather(out[f"{K}has_pair"].sum()).sum()
        if self.args.dpo_variant == "dpo":
            if self._replay_ref_source == "column":
                logps = [(_finite(x, "ref_chosen_logps"), _finite(x, "ref_rejected_logps")) if has else (0.0, 0.0)
                         for x, has in zip(inputs, has_pair)]  # fmt: skip
                ref = torch.tensor(logps, dtype=torch.float32, device=device)
            else:
                ref = self._reference_pair_logps(output, out)
            out[f"{K}ref_chosen_logps"], out[f"{K}ref_rejected_logps"] = ref[:, 0], ref[:, 1]
        return out

    @torch.no_grad()
    def _reference_pair_logps(self, output: dict[str, Any], pairs: dict[str, Any]) -> Tensor:
        rows = pairs[f"{K}has_pair"].nonzero().squeeze(-1)
        result = torch.zeros(len(pairs[f"{K}has_pair"]), 2, device=self.accelerator.device)
        if rows.numel() == 0:
            return result
        ctx: AbstractContextManager[Any] = nullcontext()
        model = self._replay_ref_model
        if self._replay_ref_source == "ref_model":
            model = self.ref_model
        elif self._replay_ref_source == "peft_base":
            ctx, model = use_adapter(self.accelerator.unwrap_model(self.model), adapter_name=None), self.model
        with ctx:
            c, r = self._pair_logps(model, output, pairs, rows)
        result[rows, 0], result[rows, 1] = c.float(), r.float()
        return result

    def _pair_logps(
        self, model: Any, inputs: dict[str, Any], pairs: dict[str, Any], rows: Tensor, sides: int = 2
    ) -> tuple[Tensor, Tensor]:
        """Summed log-probs of chosen and rejected after the prompt, one forward over [2P, P_len + L]
        (``sides=1``: the chosen rows only, [P, ...]; the rejected sums returned are then empty)."""
        p_ids, p_mask = inputs["prompt_ids"][rows], inputs["prompt_mask"][rows]
        names = ("chosen", "rejected")[:sides]
        pair_ids = torch.cat([pairs[f"{K}{s}_ids"][rows] for s in names], dim=0)
        # Attend over every real token; score only the masked ones.
        pair_attn = torch.cat([pairs[f"{K}{s}_attn"][rows] for s in names], dim=0)
        input_ids = torch.cat([torch.cat([p_ids] * sides, dim=0), pair_ids], dim=1)
        attention = torch.cat([torch.cat([p_mask] * sides, dim=0), pair_attn], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(model, input_ids, attention, pair_ids.size(1))
        summed = (logps * torch.cat([pairs[f"{K}{s}_mask"][rows] for s in names], dim=0)).sum(-1)
        n = rows.numel()
        return summed[:n], summed[n:]

    # ------------------------------------------------------------------ the loss

    def _fill_replay(
        self,
        batch: ComposerBatch,
        model: Any,
        inputs: dict[str, Any],
        sums: tuple[Tensor, Tensor] | None = None,
        policy_logps: Tensor | None = None,
    ) -> None:
        """Channel-3 inputs; ``sums``: the pairs' summed log-probs when the student's forward computed them;
        ``policy_logps`` [B, T] (on-policy pairs): the rejected side is the row's own completion, summed from it."""
        rows = inputs[f"{K}has_pair"].nonzero().squeeze(-1)
        sides = 1 if policy_logps is not None else 2
        chosen, rejected = sums if sums is not None else self._pair_logps(model, inputs, inputs, rows, sides)
        if policy_logps is not None:
            width = policy_logps.size(1)
            rejected = (policy_logps[rows] * inputs[f"{K}rejected_mask"][rows, :width]).sum(-1)
        batch.chosen_logps, batch.rejected_logps = chosen, rejected
        batch.chosen_lengths = inputs[f"{K}chosen_mask"][rows].sum(-1)
        batch.rejected_lengths = inputs[f"{K}rejected_mask"][rows].sum(-1)
        if self.args.dpo_variant == "dpo":
            batch.ref_chosen_logps = inputs[f"{K}ref_chosen_logps"][rows].to(chosen.dtype)
            batch.ref_rejected_logps = inputs[f"{K}ref_rejected_logps"][rows].to(rejected.dtype)


class MergedPairs:
    """The chosen/rejected rows of a micro-batch appended to the student's rows, for one forward.

    Rows: the B policy rows (prompt ⊕ completion), then P chosen and P rejected rows (prompt ⊕ action), all
    right-padded to one width W = max(T, pair width) with attention 0 after each row's end, so (causal
    attention) every real position sees exactly what it saw in separate forwards. ``policy`` slices the B
    policy rows' first T positions back out; ``pair_sums`` gives the pairs' summed log-probs, as
    ``ReplayPairs._pair_logps`` computes them. ``sides=1`` (on-policy pairs): the chosen rows only.
    """

    def __init__(self, inputs: dict[str, Any], t: int, pad_id: int, sides: int = 2) -> None:
        rows = inputs[f"{K}has_pair"].nonzero().squeeze(-1)
        self.b, self.t, self.n, self.pad_id = inputs["completion_ids"].size(0), t, rows.numel(), pad_id
        self.prompt_ids, self.prompt_mask = inputs["prompt_ids"][rows], inputs["prompt_mask"][rows]
        self.sides = sides
        names = ("chosen", "rejected")[:sides]
        self.pair_ids, self.pair_attn, self.pair_mask = (
            torch.cat([inputs[f"{K}{s}_{kind}"][rows] for s in names]) for kind in ("ids", "attn", "mask")
        )
        self.width = max(t, self.pair_ids.size(1))

    @staticmethod
    def _pad(x: Tensor, extra: int, fill: int) -> Tensor:
        return x if extra == 0 else torch.cat([x, x.new_full((x.size(0), extra), fill)], dim=1)

    def _rows(self, policy: Tensor, prompt: Tensor, pair: Tensor, fill: int) -> Tensor:
        pairs = torch.cat(
            [torch.cat([prompt] * self.sides), self._pad(pair, self.width - pair.size(1), fill)], 1
        )
        return torch.cat([self._pad(policy, self.width - self.t, fill), pairs])

    def input_ids(self, policy_ids: Tensor) -> Tensor:
        """[B + 2P, prompt + W]: policy rows (prompt ⊕ completion) then chosen and rejected rows."""
        return self._rows(policy_ids, self.prompt_ids, self.pair_ids, self.pad_id)

    def attention(self, policy_mask: Tensor) -> Tensor:
        return self._rows(policy_mask, self.prompt_mask, self.pair_attn, 0)

    def policy(self, x: Tensor | None) -> Tensor:
        assert x is not None
        return x[: self.b, : self.t]

    def policy_hidden(self, hidden: Tensor) -> Tensor:
        """Hidden states [B, P + T, H] of the policy rows (what a forward of those rows alone returns)."""
        return hidden[: self.b, : hidden.size(1) - (self.width - self.t)]

    def pair_sums(self, logps: Tensor) -> tuple[Tensor, Tensor]:
        summed = (logps[self.b :, : self.pair_ids.size(1)] * self.pair_mask).sum(-1)
        return summed[: self.n], summed[self.n :]


def _assistant_text(messages: list[dict[str, Any]], name: str) -> str:
    """The text a one-action message list is scored on; refuses what text scoring would drop.

    An action made of tool calls (``content`` None or empty, as in composer_core trace records of
    coding agents) would otherwise be scored on nothing but EOS, and a text + tool-call action on its
    prose only, so both raise instead of silently comparing the wrong thing.
    """
    texts = []
    for msg in (m for m in messages if m.get("role") == "assistant"):
        if msg.get("tool_calls"):
            raise ValueError(
                f"`{name}` holds an assistant message with tool calls, which are not rendered as text here "
                "(the pair would compare only the prose around them). Render the action with your chat "
                f"template and pass `{name}` as text or token ids (with `{name}_mask`), or drop the pair."
            )
        content = msg.get("content")
        if not isinstance(content, str):
            raise ValueError(
                f"`{name}` holds an assistant message whose content is {type(content).__name__}, not text; "
                f"pass `{name}` as text or token ids."
            )
        texts.append(content)
    if not texts:
        raise ValueError(f"`{name}` is a message list without an assistant message; pass the action's text.")
    return "".join(texts)


def _finite(row: dict[str, Any], key: str) -> float:
    value = column(row, key)
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(
            f"`{key}` must be a finite float (summed reference log-prob) in every pair row, got {value!r}."
        )
    return float(value)
