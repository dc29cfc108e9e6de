"""What ``ComposerGRPOTrainer`` logs and schedules around its loss: TRL's own loss metrics, the entropy bonus,
composer's per-channel values, the per-channel gradient norms and TAID's ``t``.

Gradient norms: on the micro-batches of a step that TRL logs, ``torch.autograd.grad`` of each weighted channel term
(``policy``, ``alpha_sdpo·sdpo``, ``beta_replay·replay``) w.r.t. the trainable parameters, ``retain_graph=True``:
one extra backward per channel on logging steps and one gradient-sized float32 buffer per channel while the step
accumulates; the parameters' ``.grad`` and so the update are untouched. The norm is taken of the gradient summed
over the accumulation window and averaged over processes (as DDP averages), i.e. each channel's part of the
gradient TRL clips and logs as ``grad_norm``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from composer_core.loss.compose import ComposeResult
from composer_core.loss.config import TAID, ComposeConfig
from composer_core.loss.metrics import ADAPTER_PREFIX
from composer_core.loss.surrogates import log_importance_weights, vespo_weights
from composer_core.loss.wrappers import TAIDScheduler
from torch import Tensor
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.trainer.utils import nanmax, nanmin

from composer_trl.config import ComposerGRPOConfig

_SUMMED = ("sdpo/skipped", "replay/skipped", "sdpo/tokens", "replay/pairs")  # summed over processes


class ComposerMetrics(GRPOTrainer):
    """The metrics and schedules layer of :class:`~composer_trl.ComposerGRPOTrainer` (module docstring)."""

    args: ComposerGRPOConfig
    model: torch.nn.Module  # Trainer.__init__ sets it; never None in a constructed trainer
    compose_config: ComposeConfig  # built once, at construction
    _composer_window: dict[str, Tensor]
    _grad_norms: ChannelGradNorms
    _taid: TAIDScheduler | None
    _taid_pending: float | None

    def _setup_metrics(self) -> None:
        self._composer_window = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        self._grad_norms = ChannelGradNorms()
        self._taid, self._taid_pending = None, None
        taid = self.compose_config.sdpo.wrapper
        if isinstance(taid, TAID):
            a = self.args
            self._taid = TAIDScheduler(
                int(a.max_steps), taid.t_start, taid.t_end, a.taid_alpha, a.taid_momentum
            )
            self.add_callback(_TAIDCallback(self))

    def _log_trl_metrics(
        self,
        mode: str,
        logps: Tensor,
        entropies: Tensor,
        mask: Tensor,
        inputs: dict[str, Any],
        *,
        policy: bool,
    ) -> None:
        """The metrics plain GRPOTrainer logs from its loss, same names and values: ``kl`` (bias-corrected when
        TRL's ``use_bias_correction_kl`` is), ``entropy``, and by loss type ``clip_ratio/*`` (the clip family),
        ``cispo_clip_ratio`` or ``vespo/phi_seq_mean`` (``aux_loss`` for MoE models and ``policy_loss`` /
        ``entropy_coef`` with the entropy bonus are logged in ``_compute_loss``). ``policy=False``
        (``w_policy=0``): ``entropy`` only."""

        def global_masked_mean(x: Tensor) -> float:
            if x.shape[1] == 1:  # sequence level: one value per sequence
                local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
            else:
                local = torch.stack([(x * mask).sum(), mask.sum().float()])
            totals = self.accelerator.reduce(local, reduction="sum")
            return float((totals[0] / totals[1].clamp(min=1.0)).item())

        def masked_seq_mean(x: Tensor) -> Tensor:  # NaN for an empty row, skipped by nanmin/nanmax (TRL)
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        m = self._metrics[mode]
        m["entropy"].append(global_masked_mean(entropies.detach()))
        if not policy:
            return
        old = inputs.get("old_per_token_logps")
        log_ratio = logps.detach() - (logps.detach() if old is None else old)
        coef = torch.exp(log_importance_weights(log_ratio, mask, self.importance_sampling_level))
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            kl = torch.exp(ref - logps.detach()) - (ref - logps.detach()) - 1
            m["kl"].append(global_masked_mean(kl * coef if self.args.use_bias_correction_kl else kl))
        adv = _advantages(inputs)
        if self.loss_type == "cispo":
            m["cispo_clip_ratio"].append(global_masked_mean(((coef > self.epsilon_high) & (adv > 0)).float()))
        elif self.loss_type == "vespo":
            a = self.args
            shape = (a.vespo_k_pos, a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg)
            phi = vespo_weights(adv, log_ratio, mask, inputs.get("importance_sampling_ratio"), *shape)
            m["vespo/phi_seq_mean"].append(global_masked_mean(phi))
        elif self.loss_type != "sapo":
            low = ((coef < 1 - self.epsilon_low) & (adv < 0)).float()
            high = ((coef > 1 + self.epsilon_high) & (adv > 0)).float()
            m["clip_ratio/low_mean"].append(global_masked_mean(low))
            m["clip_ratio/high_mean"].append(global_masked_mean(high))
            m["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(low, high)))
            m["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(low))).item())
            m["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(high))).item())

    def _surrogate_masks(
        self, logps: Tensor, entropies: Tensor, mask: Tensor, inputs: dict[str, Any]
    ) -> tuple[Tensor | None, Tensor | None]:
        """TRL's high-entropy token mask (``top_entropy_quantile``) and off-policy sequence mask
        (``off_policy_mask_threshold``), computed by GRPOTrainer's own methods: (their product, the entropy mask)."""
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        keep = entropy_mask
        if self.off_policy_mask_threshold is not None:
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            off = self.get_off_policy_mask(
                advantages=_advantages(inputs),
                per_token_logps=logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
            keep = off if keep is None else off * keep
        return keep, entropy_mask

    def _entropy_bonus(self, entropies: Tensor, mask: Tensor, mode: str, policy: Tensor) -> Tensor | None:
        """TRL's entropy bonus ``coef · H`` (H the mean entropy over ``mask``, scaled for accumulation), to subtract
        from the loss; ``use_adaptive_entropy`` moves ``coef`` once per optimiser step from the window's entropy."""
        if not self._entropy_bonus_enabled:
            return None
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        h = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        coef = self.entropy_coef
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            coef = 0.0
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            self._adapt_entropy_coef(torch.stack([(entropies * mask).sum(), mask.sum()]).detach())
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return coef * h

    def _adapt_entropy_coef(self, stats: Tensor) -> None:
        """Accumulate (Σ entropy, tokens) over the window; at its end move ``entropy_coef`` by ``entropy_coef_delta``
        towards ``entropy_target`` from the global mean, within [``entropy_coef_min``, ``entropy_coef_max``]."""
        window: Tensor | None = self._entropy_window_stats
        window = stats if window is None else window + stats
        self._entropy_window_stats = window  # type: ignore[assignment]  # TRL declares it None at construction
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(window, reduction="sum")
        world = (totals[0] / totals[1].clamp(min=1.0)).item()
        a = self.args
        if world <= a.entropy_target:
            self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min)
        self._last_world_entropy = world
        self._entropy_window_stats = None

    def _log_channel_grad_norms(self, model: torch.nn.Module, result: ComposeResult) -> None:
        """On the micro-batches of a logged optimiser step: each weighted channel term's gradient (module docstring)."""
        c = self.compose_config
        weights = {"policy": c.w_policy, "sdpo": c.alpha_sdpo, "replay": c.beta_replay}
        terms = {name: getattr(result, name) for name in weights}
        self._grad_norms.add(model, {k: None if t is None else weights[k] * t for k, t in terms.items()})
        if self.accelerator.sync_gradients:
            self._grad_norms.log(self)

    def _log_composer_metrics(self, mode: str, policy: Tensor, result: ComposeResult, total: Tensor) -> None:
        """Accumulate each channel's contribution over the accumulation window; log once per optimiser step, under
        ``composer/`` + composer_core's ``METRIC_KEYS`` (the README's list; TRL logs its own ``policy/*``: ``kl``,
        ``clip_ratio/*``). Channel losses are unweighted, 0 for a skipped channel; counts summed over processes."""
        m, w = result.metrics, self._composer_window
        step: dict[str, Any] = {
            "loss/policy": policy.double().cpu(),
            "loss/total": total.double().cpu(),
            "loss/sdpo": 0.0 if result.sdpo is None else float(result.sdpo.detach()),
            "loss/replay": 0.0 if result.replay is None else float(result.replay.detach()),
            **{k: m.get(k, 1.0 if k.endswith("skipped") else 0.0) for k in _SUMMED},
            "replay/correct": m.get("replay/accuracy", 0.0) * m.get("replay/pairs", 0.0),
        }
        for k, v in step.items():
            w[k] = w[k] + v
        if mode == "train" and not self.accelerator.sync_gradients:
            return
        keys = sorted(w)
        summed = self.accelerator.reduce(torch.stack([w[k] for k in keys]).to(self.accelerator.device), "sum")
        vals, n, out = dict(zip(keys, summed.tolist())), self.accelerator.num_processes, self._metrics[mode]
        for k in ("loss/policy", "loss/sdpo", "loss/replay", "loss/total", *_SUMMED):
            out[ADAPTER_PREFIX + k].append(vals[k] if k in _SUMMED else vals[k] / n)
        if vals["replay/pairs"] > 0:
            out[ADAPTER_PREFIX + "replay/accuracy"].append(vals["replay/correct"] / vals["replay/pairs"])
        if self._taid is not None:
            out[ADAPTER_PREFIX + "taid/t"].append(self._taid.t)
            if mode == "train":
                self._taid_pending = vals["loss/sdpo"] / n
        w.clear()


def _advantages(inputs: dict[str, Any]) -> Tensor:
    adv: Tensor = inputs["advantages"]
    return adv.unsqueeze(1) if adv.dim() == 1 else adv


class _TAIDCallback(TrainerCallback):
    """Advances TAID's t once per optimiser step (``on_step_end``, never during evaluation) from the globally
    reduced SDPO loss of that step."""

    def __init__(self, trainer: ComposerMetrics) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        t = self.trainer
        if t._taid is not None and t._taid_pending is not None:
            t._taid.step(t._taid_pending)
            t._taid_pending = None
        return control


class ChannelGradNorms:
    """Each channel's gradient summed over a logged step's micro-batches (module docstring)."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}

    def add(self, model: torch.nn.Module, terms: dict[str, Tensor | None]) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        for name, term in terms.items():
            grads: Sequence[Tensor | None] = [None] * len(params)
            if term is not None and term.requires_grad:
                grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
            flat = torch.cat(
                [p.new_zeros(p.numel(), dtype=torch.float32) if g is None else g.reshape(-1).float()
                 for p, g in zip(params, grads)]
            )  # fmt: skip
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
