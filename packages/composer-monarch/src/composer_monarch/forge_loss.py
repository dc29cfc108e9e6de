"""The composer objective as a TorchForge loss: ``loss(logits, **targets) -> Tensor``.

TorchForge's ``TitanTrainer(loss=...)`` calls ``self.loss(logits, **targets)`` with its ``collate``'s targets
``response`` [b, s], ``ref_logprobs`` [b, s], ``advantages`` [b, 1] and ``padding_mask`` [b, s]; :class:`ComposerLoss`
takes exactly those (a drop-in for ``simple_grpo_loss``) and optional extra targets (:data:`TARGETS`) that switch
on composer's other channels: total = policy (GRPO family) + α · SDPO(student ‖ hinted teacher) + β ·
DPO/SimPO(replay pairs) (``composer_core.loss.compose.compose_loss``; SDPO: Hübotter et al. 2026, DPO: Rafailov
et al. 2023, SimPO: Meng et al. 2024). The bare ``ComposerLoss()`` is TorchForge's GRPO loss (DeepSeekMath arXiv
2402.03300, k3 KL of Schulman's estimator note; :data:`FORGE_DEFAULTS`); per token, with ℓ = log
softmax(logits / τ)[response] and r = ref_logprobs:

    L_t = −(exp(ℓ − sg ℓ)·A − β·(exp(r − ℓ) − (r − ℓ) − 1)),   β = 0.1
    loss = mean_rows( Σ_t L_t·mask / max(Σ_t mask, 1) )        (per-sequence mean, then batch mean)

Shapes: logits [R, P+s, V] (or [R, s, V] with ``align=False``), response/mask/ref [R, s], A [R, 1]. Channel-3
pairs ride in the same forward pass as extra rows (``chosen_rows`` / ``rejected_rows``, left out of channels 1
and 2); their summed log-probs, and the reference's from the same rows of ``ref_logprobs``, are the DPO/SimPO
inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from composer_core.loss.compose import ComposerBatch, compose_loss
from composer_core.loss.config import DPO, PER_CALL, ComposeConfig, coerce_option
from composer_core.loss.options import PolicyOptions
from torch import Tensor

from composer_monarch.model import token_logprobs, upcast

#: Targets the callable understands, with their shapes (R rows, s response tokens, V vocabulary).
TARGETS: dict[str, str] = {
    "response": "[R, s] long — response tokens (TorchForge)",
    "padding_mask": "[R, s] bool — True on real response tokens (TorchForge)",
    "advantages": "[R, 1], [R] or [R, s] — advantages (TorchForge: [b, 1])",
    "ref_logprobs": "[R, s] — reference log-probs (TorchForge); KL term and DPO reference",
    "old_logprobs": "[R, s] — log-probs of the policy that sampled (clipped ratio)",
    "inference_logprobs": "[R, s] — sampler log-probs for rollout correction",
    "rollout_is_weights": "[R, s] — precomputed importance weights",
    "teacher_logits": "[R, s, V] — hinted-context teacher logits at the response positions",
    "teacher_logprobs": "[R, s] — hinted-context teacher log-probs of the response tokens",
    "sdpo_mask": "[R, s] bool — tokens distilled in channel 2 (default: padding_mask)",
    "policy_rows": "[R] bool — rows of channels 1 and 2 (default: all rows that are not pair rows)",
    "chosen_rows": "[P] long — row index of each pair's chosen completion (channel 3)",
    "rejected_rows": "[P] long — row index of each pair's rejected completion (channel 3)",
}


#: Where ``ComposerLoss()`` differs from ``compose_loss``'s defaults to be TorchForge's ``simple_grpo_loss``
#: (whose k3 KL estimator is core's default, read from core).
FORGE_DEFAULTS: dict[str, Any] = dict(loss_type="grpo", kl_beta=0.1, kl_estimator=PolicyOptions.kl_estimator)


class ComposerLoss:
    """TorchForge-compatible loss callable computing composer's 3-channel objective.

    Args:
        align: True (TorchForge's default) when ``logits`` cover the whole sequence [R, L, V]
            (prompt ⊕ response); the positions that predict the response, ``logits[:, -s-1:-1]``,
            are used. False when ``logits`` are already aligned with ``response`` ([R, s, V]).
        temperature: logits are divided by it before the log-softmax (match the sampler's), in the
            logits' dtype and then upcast to float32, in TorchForge's order (``compute_logprobs``).
        **options: any keyword of ``composer_core.compose_loss`` (``alpha_sdpo``, ``beta_replay``,
            ``loss_type``, ``kl_beta``, ``sdpo_beta``, ``dpo_variant`` …); unset, :data:`FORGE_DEFAULTS`, then
            ``compose_loss``'s. ``w_policy=0`` is pure self-distillation: no policy term, no KL defaults.

    After each call ``last_result`` holds the ``ComposeResult`` (per-channel losses and metrics).
    """

    def __init__(self, *, align: bool = True, temperature: float = 1.0, **options: Any) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature={temperature}: must be > 0")
        self.align = align
        self.temperature = float(temperature)
        pure = "w_policy" in options and coerce_option("w_policy", options["w_policy"]) == 0
        defaults = {k: v for k, v in FORGE_DEFAULTS.items() if not (pure and k.startswith("kl_"))}
        self.options = {**defaults, **options}
        self.normalizers = {k: self.options[k] for k in PER_CALL if k in self.options}
        try:
            self.config = ComposeConfig.from_flat(
                **{k: v for k, v in self.options.items() if k not in PER_CALL}
            )
        except ValueError as err:
            if "unknown option" in str(err):
                raise ValueError(f"ComposerLoss: unknown compose_loss option(s): {err}") from None
            raise
        self.last_result: Any = None

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"ComposerLoss(align={self.align}, temperature={self.temperature}{', ' if opts else ''}{opts})"

    @property
    def needs_reference(self) -> bool:
        """True when the options use reference log-probs (KL penalty or DPO on replay pairs)."""
        dpo = self.config.beta_replay != 0.0 and isinstance(self.config.replay, DPO)
        return self.config.policy.kl_beta != 0.0 or dpo

    def __call__(self, logits: Tensor, **targets: Tensor) -> Tensor:
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise ValueError(f"ComposerLoss: unknown target(s) {unknown}; known targets: {sorted(TARGETS)}")
        for name in ("response", "padding_mask", "advantages"):
            if targets.get(name) is None:
                raise ValueError(f"ComposerLoss: target {name!r} is required ({TARGETS[name]})")
        response = targets["response"]
        logits = self._response_logits(logits, response)
        logprobs = token_logprobs(logits, response)
        mask = targets["padding_mask"].bool()
        policy_rows, chosen, rejected = self._rows(targets, response.shape[0], logits.device)
        fields = self._policy_fields(targets, logits, logprobs, mask, policy_rows.nonzero().squeeze(-1))
        if chosen is not None and rejected is not None:
            fields.update(_pair_fields(targets, logprobs, mask, chosen, rejected))
        self.last_result = compose_loss(ComposerBatch(**fields), self.config, **self.normalizers)
        return self.last_result.total  # type: ignore[no-any-return]

    def _response_logits(self, logits: Tensor, response: Tensor) -> Tensor:
        """The logits that predict each response token ([rows, response_len, vocab], temperature applied, upcast
        to float32 at least)."""
        if response.dim() != 2:
            raise ValueError(f"response has shape {tuple(response.shape)}; expected [rows, response_len]")
        rows, s = response.shape
        if logits.dim() != 3 or logits.shape[0] != rows:
            raise ValueError(
                f"logits has shape {tuple(logits.shape)}; expected [{rows}, length, vocab] (one row per response)"
            )
        if self.align:
            if logits.shape[1] < s + 1:
                raise ValueError(
                    f"logits cover {logits.shape[1]} positions but response has {s} tokens: with align=True "
                    "logits must span prompt ⊕ response (≥ response_len + 1); pass align=False for "
                    "logits already aligned with the response"
                )
            logits = logits[:, -s - 1 : -1]
        elif logits.shape[1] != s:
            raise ValueError(f"align=False needs logits [{rows}, {s}, vocab]; got {tuple(logits.shape)}")
        return upcast(logits / self.temperature if self.temperature != 1.0 else logits)  # TorchForge's order

    def _policy_fields(
        self, targets: dict[str, Tensor], logits: Tensor, logprobs: Tensor, mask: Tensor, pick: Tensor
    ) -> dict[str, Any]:
        """The batch fields of channels 1 and 2 on the sampled rows ``pick``."""

        def sel(name: str) -> Tensor | None:
            return None if targets.get(name) is None else targets[name][pick]

        adv = targets["advantages"][pick]
        if adv.dim() == 2 and adv.shape[1] == 1 and logprobs.shape[1] != 1:
            adv = adv.squeeze(-1)
        fields: dict[str, Any] = {
            "logprobs": logprobs[pick],
            "advantages": adv,
            "completion_mask": mask[pick],
            "old_logprobs": sel("old_logprobs"),
            # TorchForge always sends ref_logprobs; channel 1 reads them only for the KL penalty.
            "ref_logprobs": sel("ref_logprobs") if self.config.policy.kl_beta != 0.0 else None,
            "inference_logprobs": sel("inference_logprobs"),
            "rollout_is_weights": sel("rollout_is_weights"),
        }
        teacher = {
            k: t[pick].detach()
            for k in ("teacher_logits", "teacher_logprobs")
            if (t := targets.get(k)) is not None
        }
        if teacher:
            sdpo_mask = targets.get("sdpo_mask")
            fields.update(teacher, sdpo_mask=(mask if sdpo_mask is None else sdpo_mask.bool())[pick])
            if "teacher_logits" in teacher:
                fields["student_logits"] = logits[pick]
        elif targets.get("sdpo_mask") is not None:
            raise ValueError("sdpo_mask was given without teacher_logits or teacher_logprobs (channel 2)")
        return fields

    @staticmethod
    def _rows(
        targets: dict[str, Tensor], rows: int, device: torch.device
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Row selections on ``device`` (the logits'): channel-1/2 rows, chosen rows, rejected rows."""
        chosen, rejected = targets.get("chosen_rows"), targets.get("rejected_rows")
        if (chosen is None) != (rejected is None):
            raise ValueError("chosen_rows and rejected_rows come together (channel-3 pairs); got only one")
        both = None
        if chosen is not None and rejected is not None:  # equal lengths: compose_loss checks the pair sums
            chosen = chosen.to(device=device, dtype=torch.long).reshape(-1)
            rejected = rejected.to(device=device, dtype=torch.long).reshape(-1)
            both = torch.cat([chosen, rejected])
            if both.numel() and (both.min() < 0 or both.max() >= rows):
                raise ValueError(f"chosen_rows/rejected_rows index rows 0..{rows - 1}; got {both.tolist()}")
        policy_rows = targets.get("policy_rows")
        if policy_rows is None:
            policy_rows = torch.ones(rows, dtype=torch.bool, device=device)
            if both is not None:
                policy_rows[both] = False
        else:
            policy_rows = policy_rows.to(device=device, dtype=torch.bool).reshape(-1)
            if policy_rows.numel() != rows:
                raise ValueError(f"policy_rows has {policy_rows.numel()} entries; need one per row ({rows})")
        if not bool(policy_rows.any()):
            raise ValueError("policy_rows selects no row: channel 1 needs at least one sampled completion")
        return policy_rows, chosen, rejected


def _pair_fields(
    targets: dict[str, Tensor], logprobs: Tensor, mask: Tensor, chosen: Tensor, rejected: Tensor
) -> dict[str, Tensor]:
    """Channel 3's batch fields: summed log-probs and lengths of the chosen and rejected rows, and the
    reference's sums when ``ref_logprobs`` is given."""
    token_sums = (logprobs * mask).sum(-1)
    lengths = mask.sum(-1)
    fields = {
        "chosen_logps": token_sums[chosen],
        "rejected_logps": token_sums[rejected],
        "chosen_lengths": lengths[chosen],
        "rejected_lengths": lengths[rejected],
    }
    ref = targets.get("ref_logprobs")
    if ref is not None:
        ref_sums = (ref.detach() * mask).sum(-1)
        fields["ref_chosen_logps"] = ref_sums[chosen]
        fields["ref_rejected_logps"] = ref_sums[rejected]
    return fields
