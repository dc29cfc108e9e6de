"""Conformance suite: every adapter must compute the same numbers as :func:`composer_core.compose_loss`.

Pytest-free, so each adapter runs it inside its own host's test session::

    from composer_core.testing import check_adapter

    def compute(batch, options):            # host-side: translate, run the host's loss path, return the total
        return my_trainer_loss(to_host_inputs(batch), **to_host_config(options))

    check_adapter(compute, supports={"policy", "sdpo_full", "dpo"}, atol=1e-6, rtol=1e-5)

A :class:`ConformanceCase` is a batch factory (fresh leaves on every call), ``compose_loss`` options and
closed-form values where one exists (JSD_½ of [0.9, 0.1] vs [0.5, 0.5] is 0.10175; DPO at initialisation is
ln 2). ``check_adapter`` checks ``compose_loss`` against the closed form, then the adapter's total against
``compose_loss`` in value and in the gradient of every input that requires grad. A case runs when all its tags
(:data:`TAGS`) are in ``supports``; ``sdpo_compiled`` is the JSD chunk kernel under ``torch.compile`` (needs
inductor's backend: a C++ compiler on a CPU).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

from composer_core.loss.compose import ComposerBatch, ComposeResult, compose_loss

__all__ = [
    "CASES",
    "TAGS",
    "ConformanceCase",
    "ConformanceError",
    "ConformanceReport",
    "cases_for",
    "check_adapter",
]

#: An adapter's host-side computation: (batch, compose_loss options) -> total loss (or a ComposeResult).
Compute = Callable[[ComposerBatch, Mapping[str, Any]], "Tensor | ComposeResult"]


@dataclass(frozen=True)
class ConformanceCase:
    """One conformance case: ``make_batch(dtype)`` builds fresh leaves; ``expected`` holds closed forms."""

    name: str
    tags: frozenset[str]
    make_batch: Callable[[torch.dtype], ComposerBatch]
    options: Mapping[str, Any] = field(default_factory=dict)
    expected: Mapping[str, float] = field(default_factory=dict)
    description: str = ""


class ConformanceError(AssertionError):
    """Raised by :func:`check_adapter` with every mismatch found."""


@dataclass
class ConformanceReport:
    """Which cases ran and which were skipped (unsupported tags)."""

    passed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------- case helpers
def _t(values: Any, dtype: torch.dtype, grad: bool = False) -> Tensor:
    return torch.tensor(values, dtype=dtype).requires_grad_(grad)


def _policy_only(dtype: torch.dtype) -> dict[str, Tensor]:
    """Channel-1 inputs of one token (ℓθ = ln .5) with zero advantage: policy loss and its gradient are 0."""
    return {
        "logprobs": _t([[math.log(0.5)]], dtype, grad=True),
        "advantages": torch.zeros(1, dtype=dtype),
        "completion_mask": torch.ones(1, 1, dtype=torch.bool),
    }


def _log(p: list[float]) -> list[float]:
    return [math.log(x) for x in p]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def _jsd(p_t: list[float], q_s: list[float], beta: float) -> float:
    if beta == 0:
        return _kl(p_t, q_s)
    if beta == 1:
        return _kl(q_s, p_t)
    m = [beta * a + (1 - beta) * b for a, b in zip(p_t, q_s)]
    return beta * _kl(p_t, m) + (1 - beta) * _kl(q_s, m)


def _random_batch(dtype: torch.dtype, seed: int, *, hidden: bool = False) -> ComposerBatch:
    g = torch.Generator().manual_seed(seed)
    b, t, v, h, p = 4, 5, 11, 6, 3

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 3:] = False
    mask[3, 2:] = False
    sdpo_mask = mask.clone()
    sdpo_mask[0] = False
    batch = ComposerBatch(
        logprobs=(r(b, t) * 0.5 - 1.5).requires_grad_(True),
        advantages=r(b),
        completion_mask=mask,
        old_logprobs=None,
        sdpo_mask=sdpo_mask,
        chosen_logps=(r(p) * 3 - 10).requires_grad_(True),
        rejected_logps=(r(p) * 3 - 10).requires_grad_(True),
        ref_chosen_logps=r(p) * 3 - 10,
        ref_rejected_logps=r(p) * 3 - 10,
        chosen_lengths=torch.tensor([4, 6, 3]),
        rejected_lengths=torch.tensor([5, 2, 7]),
        teacher_logprobs=r(b, t) * 0.5 - 1.5,
    )
    if hidden:
        batch.student_hidden = r(b, t, h).requires_grad_(True)
        batch.teacher_hidden = r(b, t, h)
        batch.lm_head_weight = r(v, h).requires_grad_(True)
    else:
        batch.student_logits = (r(b, t, v) * 2).requires_grad_(True)
        batch.teacher_logits = r(b, t, v) * 2
    return batch


def _two_token(dtype: torch.dtype, student: list[float], teacher: list[float]) -> ComposerBatch:
    return ComposerBatch(
        **_policy_only(dtype),
        student_logits=_t([[_log(student)]], dtype, grad=True),
        teacher_logits=_t([[_log(teacher)]], dtype),
    )


# ------------------------------------------------------------------------------------------------ cases
def _case(
    name: str,
    tags: str,
    make_batch: Callable[[torch.dtype], ComposerBatch],
    options: Mapping[str, Any],
    description: str,
    exact: tuple[str, float] | None = None,
) -> ConformanceCase:
    """A case with space-separated ``tags``; ``exact = (channel, value)``: that channel and the total are
    ``value`` in closed form. Channels 2 and 3 are on (weight 1: core's defaults are 0) unless ``options`` set
    their weights."""
    expected = {exact[0]: exact[1], "total": exact[1]} if exact else {}
    options = {"alpha_sdpo": 1.0, "beta_replay": 1.0, **options}
    return ConformanceCase(name, frozenset(tags.split()), make_batch, options, expected, description)


def _one_token(dtype: torch.dtype, other: str) -> ComposerBatch:
    """:func:`_policy_only` plus the batch field ``other`` (log-probs) at ln .25."""
    return ComposerBatch(**_policy_only(dtype), **{other: _t([[math.log(0.25)]], dtype)})


def _pairs(dtype: torch.dtype, h: float) -> ComposerBatch:
    """One preference pair whose chosen log-prob is ``h`` above the reference's."""
    return ComposerBatch(
        **_policy_only(dtype),
        chosen_logps=_t([h - 12.0], dtype, grad=True),
        rejected_logps=_t([-15.0], dtype, grad=True),
        ref_chosen_logps=_t([-12.0], dtype),
        ref_rejected_logps=_t([-15.0], dtype),
        chosen_lengths=torch.tensor([4]),
        rejected_lengths=torch.tensor([5]),
    )


def _policy_ratio_one(dtype: torch.dtype) -> ComposerBatch:
    return ComposerBatch(
        logprobs=_t([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]], dtype, grad=True),
        advantages=_t([1.0, -1.0], dtype),
        completion_mask=torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
    )


def _policy_clip(dtype: torch.dtype) -> ComposerBatch:
    return ComposerBatch(
        logprobs=_t([[math.log(1.5)], [math.log(0.5)]], dtype, grad=True),
        advantages=_t([1.0, -1.0], dtype),
        completion_mask=torch.ones(2, 1, dtype=torch.bool),
        old_logprobs=torch.zeros(2, 1, dtype=dtype),
    )


def _cases() -> tuple[ConformanceCase, ...]:
    q9, half, q631, uni = [0.9, 0.1], [0.5, 0.5], [0.6, 0.3, 0.1], [1 / 3] * 3
    k3 = 0.5 - math.log(0.5) - 1  # e^x − x − 1 with x = ln(0.25/0.5)
    jsd_half = _jsd(half, q9, 0.5)
    t_mix = 0.4
    taid_z = [(1 - t_mix) * a + t_mix * b for a, b in zip(_log(q9), _log(half))]
    taid_target = torch.softmax(torch.tensor(taid_z, dtype=torch.float64), 0).tolist()
    topk_fkl = 0.2 * math.log(0.2 / 0.6) + 0.8 * math.log(0.8 / 0.4)
    cases = [
        # ---- channel 1
        _case(
            "policy/ratio_one_dapo",
            "policy",
            _policy_ratio_one,
            {"alpha_sdpo": 0.0, "beta_replay": 0.0},
            "on-policy (old = sg(ℓ)): −Σ A·m / Σ m = −(2·1 + 3·(−1))/5",
            ("policy", 0.2),
        ),
        _case(
            "policy/ratio_one_global_normalizer",
            "policy global_normalizer",
            _policy_ratio_one,
            {"normalizer": 10.0},
            "dapo with the global token count 10 (e.g. 2 micro-batches): 1/10",
            ("policy", 0.1),
        ),
        _case(
            "policy/clip_higher_grpo",
            "policy",
            _policy_clip,
            {"loss_type": "grpo", "epsilon_high": 0.28},
            "ρ=1.5, A=+1, ε_hi=0.28 → −1.28; ρ=0.5, A=−1, ε_lo=0.2 → +0.8; grpo mean",
            ("policy", (-1.28 + 0.8) / 2),
        ),
        _case(
            "policy/kl_k3",
            "policy",
            lambda dt: _one_token(dt, "ref_logprobs"),
            {"kl_beta": 0.04},
            "ℓθ=ln .5, ℓref=ln .25: k3 = 0.19315, × β=0.04",
            ("policy", 0.04 * k3),
        ),
        _case(
            "policy/random_bnpo_delta",
            "policy",
            lambda dt: _random_with_old(dt, 21),
            {"loss_type": "bnpo", "epsilon_high": 0.28, "delta": 1.5},
            "random batch, old log-probs, clip-higher, two-sided delta",
        ),
        # ---- channel 2: full JSD
        *(
            _case(
                f"sdpo_full/two_token_beta_{beta}",
                "sdpo_full",
                lambda dt: _two_token(dt, q9, half),
                {"sdpo_beta": beta, "beta_replay": 0.0},
                "P_T=[.5,.5], P_S=[.9,.1]: FKL 0.51083, JSD_½ 0.10175, RKL 0.36806",
                ("sdpo", _jsd(half, q9, beta)),
            )
            for beta in (0.0, 0.5, 1.0)
        ),
        _case(
            "sdpo_full/two_token_compiled",
            "sdpo_full sdpo_compiled",
            lambda dt: _two_token(dt, q9, half),
            {"sdpo_beta": 0.5, "beta_replay": 0.0, "sdpo_compiled": True},
            "sdpo_compiled=True (the chunk kernel under torch.compile): JSD_½ 0.10175",
            ("sdpo", jsd_half),
        ),
        _case(
            "sdpo_full/random_three_channels",
            "policy sdpo_full dpo",
            lambda dt: _random_batch(dt, 1),
            {"alpha_sdpo": 0.7, "beta_replay": 0.3, "sdpo_temperature": 0.9},
            "random batch, all three channels, hint mask ≠ completion mask",
        ),
        _case(
            "sdpo_full/random_fused_hidden",
            "policy sdpo_full",
            lambda dt: replace(_random_batch(dt, 2, hidden=True), chosen_logps=None, rejected_logps=None),
            {"alpha_sdpo": 0.5, "sdpo_beta": 0.2},
            "fused hidden-state form (student_hidden, teacher_hidden, lm_head_weight)",
        ),
        _case(
            "global_normalizer/three_channels",
            "policy sdpo_full dpo global_normalizer",
            lambda dt: _random_batch(dt, 3),
            {"normalizer": 40.0, "sdpo_normalizer": 25.0, "replay_normalizer": 8.0},
            "each channel divided by its global count",
        ),
        # ---- channel 2: sampled token, top-k
        _case(
            "sdpo_sampled/check_value",
            "sdpo_sampled",
            lambda dt: _one_token(dt, "teacher_logprobs"),
            {"sdpo_form": "sampled"},
            "p_S=.5, p_T=.25: k1 value ln 2, gradient coefficient on ℓS +0.69315",
            ("sdpo", math.log(2)),
        ),
        _case(
            "sdpo_sampled/random_is_clip",
            "policy sdpo_sampled",
            lambda dt: _random_with_old(dt, 4, sampled=True),
            {"sdpo_form": "sampled", "sdpo_token_clip": 1.5},
            "random batch with old log-probs: IS ratio clipped at 1.5",
        ),
        _case(
            "sdpo_topk/tail_bucket",
            "sdpo_topk",
            lambda dt: _two_token(dt, q631, [0.2, 0.5, 0.3]),
            {"sdpo_form": "topk", "sdpo_topk": 1, "sdpo_beta": 0.0},
            "student top-1 support + tail bucket: FKL([.2,.8] ‖ [.6,.4])",
            ("sdpo", topk_fkl),
        ),
        # ---- wrappers
        _case(
            "taid/interpolated_target",
            "taid",
            lambda dt: _two_token(dt, q9, half),
            {"sdpo_wrapper": "taid", "taid_t": t_mix},
            "KL(softmax(0.6·z_S + 0.4·z_T) ‖ q_S)",
            ("sdpo", _kl(taid_target, q9)),
        ),
        _case(
            "entropy_opd/gate_open",
            "entropy_opd",
            lambda dt: _two_token(dt, q631, uni),
            {"sdpo_wrapper": "entropy_opd"},
            "uniform teacher over 3 (H = 1.0986 > 0.8): JSD_½ + FKL",
            ("sdpo", _jsd(uni, q631, 0.5) + _kl(uni, q631)),
        ),
        _case(
            "entropy_opd/gate_closed",
            "entropy_opd",
            lambda dt: _two_token(dt, q9, half),
            {"sdpo_wrapper": "entropy_opd"},
            "teacher [.5,.5] (H = 0.693 < 0.8): base JSD only",
            ("sdpo", jsd_half),
        ),
    ]
    # ---- channel 3: one pair, chosen log-prob h above the reference (name, h, options, value, description)
    simpo_x = 2.0 * ((-2.0 - 12.0) / 4 - (-15.0) / 5) - 0.5
    cdpo = -(0.8 * math.log(1 / (1 + math.exp(-1.0))) + 0.2 * math.log(1 / (1 + math.exp(1.0))))
    for name, h, options, value, description in (
        ("dpo/init_ln2", 0.0, {"alpha_sdpo": 0.0}, math.log(2), "policy = reference → ln 2 for any β"),
        ("dpo/margin_10", 10.0, {"dpo_beta": 0.1}, math.log1p(math.exp(-1.0)), "β=0.1, h=10 → 0.313262"),
        ("dpo/ipo_init", 0.0, {"dpo_loss_type": "ipo"}, 25.0, "IPO at h=0, β=0.1 → (0 − 1/(2β))² = 25"),
        ("dpo/cdpo_margin_10", 10.0, {"dpo_label_smoothing": 0.2}, cdpo, "cDPO ε=0.2 at βh=1"),
        (
            "simpo/closed_form",
            -2.0,
            {"dpo_variant": "simpo"},
            math.log1p(math.exp(-simpo_x)),
            "−log σ(2·(−14/4 + 15/5) − 0.5)",
        ),
    ):
        make = functools.partial(_pairs, h=h)
        cases.append(_case(name, name.split("/")[0], make, options, description, ("replay", value)))
    cases.append(
        _case(
            "simpo/random_three_channels",
            "policy sdpo_full simpo",
            lambda dt: _random_batch(dt, 5),
            {"dpo_variant": "simpo", "simpo_beta": 2.5, "simpo_gamma": 1.0},
            "random batch, SimPO replay",
        )
    )
    return tuple(cases)


def _noisy(like: Tensor, seed: int, scale: float) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return like.detach() + scale * torch.randn(like.shape, generator=g, dtype=torch.float64).to(like.dtype)


def _random_with_old(dtype: torch.dtype, seed: int, sampled: bool = False) -> ComposerBatch:
    """Channel-1 inputs of a random batch with old log-probs (``sampled``: and teacher log-probs)."""
    b = _random_batch(dtype, seed)
    b.old_logprobs = _noisy(b.logprobs, seed + 1000, 0.4)
    b.student_logits = b.teacher_logits = b.chosen_logps = b.rejected_logps = None
    b.teacher_logprobs = _noisy(b.logprobs, seed + 2000, 0.5) if sampled else None
    return b


CASES: tuple[ConformanceCase, ...] = _cases()
TAGS: frozenset[str] = frozenset().union(*(c.tags for c in CASES))
"""Every tag some case carries (what ``supports`` may name)."""


def cases_for(supports: set[str] | frozenset[str]) -> list[ConformanceCase]:
    """The cases whose tags are all in ``supports``."""
    unknown = set(supports) - TAGS
    if unknown:
        raise ValueError(f"unknown conformance tag(s) {sorted(unknown)}; choose from {sorted(TAGS)}.")
    return [c for c in CASES if c.tags <= set(supports)]


# ---------------------------------------------------------------------------------------------- checking
def _grad_leaves(batch: ComposerBatch) -> dict[str, Tensor]:
    leaves = {f.name: getattr(batch, f.name) for f in fields(ComposerBatch)}
    return {k: v for k, v in leaves.items() if isinstance(v, Tensor) and v.requires_grad}


def _close(a: Tensor, b: Tensor, atol: float, rtol: float) -> bool:
    return bool(
        torch.allclose(a.detach().to(torch.float64), b.detach().to(torch.float64), atol=atol, rtol=rtol)
    )


def _reference(
    case: ConformanceCase, dtype: torch.dtype, atol: float, rtol: float, failures: list[str]
) -> tuple[ComposeResult, tuple[Tensor, ...]]:
    """``compose_loss`` on the case and its gradients; a mismatch with the case's closed form is a failure."""
    ref_batch = case.make_batch(dtype)
    ref = compose_loss(ref_batch, **case.options)
    for key, expected in case.expected.items():
        got = getattr(ref, key)  # total, policy, sdpo or replay
        tol_a, tol_r = max(atol, 1e-9), max(rtol, 1e-7)
        if got is None or abs(float(got.detach()) - expected) > tol_a + tol_r * abs(expected):
            failures.append(f"[{case.name}] compose_loss {key}={got} but the closed form is {expected!r}")
    leaves = list(_grad_leaves(ref_batch).values())
    return ref, torch.autograd.grad(ref.total, leaves, allow_unused=True, materialize_grads=True)


def _check_case(
    compute: Compute,
    case: ConformanceCase,
    dtype: torch.dtype,
    ref: tuple[Tensor, tuple[Tensor, ...]],
    tolerances: tuple[float, float, bool],
    failures: list[str],
) -> bool:
    """The adapter's total and gradients on the case against the reference's; False when the case could not be
    compared (the adapter raised or returned no differentiable scalar)."""
    (ref_total, ref_grads), (atol, rtol, check_grads) = ref, tolerances
    batch = case.make_batch(dtype)
    leaves = _grad_leaves(batch)
    try:
        out = compute(batch, dict(case.options))
    except Exception as exc:  # report, then continue with the other cases
        failures.append(f"[{case.name}] the adapter raised {type(exc).__name__}: {exc}")
        return False
    if isinstance(out, ComposeResult):
        out = out.total
    if not isinstance(out, Tensor) or out.numel() != 1:
        failures.append(f"[{case.name}] the adapter returned {type(out).__name__}, not a scalar tensor")
        return False
    if not _close(out, ref_total, atol, rtol):
        failures.append(
            f"[{case.name}] total {float(out.detach())!r} != compose_loss {float(ref_total.detach())!r}"
        )
    if not check_grads:
        return True
    if not out.requires_grad:
        failures.append(f"[{case.name}] the adapter's total does not require grad")
        return False
    grads = torch.autograd.grad(out, list(leaves.values()), allow_unused=True, materialize_grads=True)
    for name, g, g_ref in zip(leaves, grads, ref_grads):  # an unused input's gradient is zeros
        if not _close(g, g_ref, atol, rtol):
            err = float((g.detach().double() - g_ref.detach().double()).abs().max())
            failures.append(
                f"[{case.name}] d total / d {name} differs from compose_loss (max abs err {err:.3g})"
            )
    return True


def check_adapter(
    compute: Compute,
    *,
    supports: set[str] | frozenset[str],
    atol: float = 1e-6,
    rtol: float = 1e-5,
    dtype: torch.dtype = torch.float64,
    check_grads: bool = True,
) -> ConformanceReport:
    """Run every supported case through ``compute`` and compare with :func:`compose_loss`.

    Args:
        compute: ``(batch, options) -> total`` (a scalar tensor, or a ComposeResult), the adapter's host-side
            path. It must not mutate ``batch``; its total must be differentiable w.r.t. the batch tensors that
            require grad (unless ``check_grads=False``, for hosts whose loss cannot be connected to them).
        supports: tags the adapter implements (see the module docstring); other cases are skipped.
        atol / rtol: tolerances for values and gradients (``torch.allclose``); the closed-form anchors use
            ``max(atol, 1e-9)`` / ``max(rtol, 1e-7)`` against ``compose_loss``.
        dtype: floating dtype of the batch tensors (float64 by default; hosts in float32 pass float32).

    Returns a :class:`ConformanceReport`; raises :class:`ConformanceError` listing every mismatch.
    """
    if not supports:
        raise ValueError("`supports` is empty; pass the tags the adapter implements, e.g. {'policy'}.")
    selected = cases_for(supports)
    report = ConformanceReport(skipped=[c.name for c in CASES if c not in selected])
    failures: list[str] = []
    for case in selected:
        ref, ref_grads = _reference(case, dtype, atol, rtol, failures)
        if _check_case(compute, case, dtype, (ref.total, ref_grads), (atol, rtol, check_grads), failures):
            report.passed.append(case.name)
    if failures:
        raise ConformanceError(f"{len(failures)} conformance failure(s):\n  " + "\n  ".join(failures))
    return report
