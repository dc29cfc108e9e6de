"""Paired comparison of two arms over seeds: the statistics the real-model comparison's verdicts are made of.

Pure Python (``math``, ``random``, ``statistics``; no scipy). Two arms are compared on the same seeds: each seed
gives one paired difference ``d_s = A_s − B_s`` (e.g. final held-out exact match of arm A minus arm B, both
trained on seed ``s``'s rows and scored on the same fixed held-out set), and the comparison is a one-sample
analysis of the ``d_s``:

- **mean** ``d̄`` and **paired SD** ``s_d`` (``n − 1`` denominator);
- **95 % t interval** ``d̄ ± t_{0.975, n−1} · s_d / √n`` — the interval the verdict uses. The t quantile is exact:
  Student's t CDF for an integer number of degrees of freedom has a closed form (Abramowitz & Stegun 26.7.3/4),
  inverted by bisection (:func:`t_quantile`);
- **95 % percentile bootstrap** of ``d̄`` (``B`` resamples of the seeds, a fixed RNG seed), reported beside it;
  at a handful of seeds it is narrower than the t interval (it ignores the t tail and uses the ``1/n`` SD), so it
  never decides a verdict;
- **seeds needed** to detect a difference ``δ`` (default 0.05) at 80 % power with a two-sided α = 0.05 test,
  from the paired SD by the normal approximation ``n = ⌈((z_{0.975} + z_{0.8}) · s_d / δ)²⌉``;
- a **verdict** sentence made from those numbers: ``"<A> beats <B>"`` when the whole t interval is above 0,
  ``"<A> loses to <B>"`` when it is below 0, ``"not distinguishable"`` when it contains 0.

:func:`mcnemar` is the per-prompt view: the final greedy correct/incorrect of A and B on each held-out prompt,
discordant pairs pooled over seeds, an exact two-sided binomial (McNemar) p-value. Pooling treats the
(seed, prompt) pairs as independent, which they are not (the same prompts recur across seeds): a descriptive
companion to the seed-level interval, not a second verdict.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["PairedComparison", "mcnemar", "paired_comparison", "seeds_needed", "t_quantile", "verdict"]

LEVEL = 0.95
DELTA = 0.05
POWER = 0.8
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


def _t_central(t: float, df: int) -> float:
    """``P(|T| ≤ t)`` for Student's t with integer ``df`` ≥ 1 (closed form, A&S 26.7.3 and 26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(3, df, 2):  # 1 + (2/3)c² + (2·4)/(3·5)c⁴ + ... up to c^(df−3)
            term *= (k - 1) / k * c2
            total += term
        return 2.0 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    term, total = 1.0, 1.0
    for k in range(2, df - 1, 2):  # 1 + (1/2)c² + (1·3)/(2·4)c⁴ + ... up to c^(df−2)
        term *= (k - 1) / k * c2
        total += term
    return math.sin(theta) * total


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (``p`` in (0.5, 1)) of Student's t with ``df`` degrees of freedom, to 1e-12."""
    if not 0.5 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df ≥ 1, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while _t_central(hi, df) < 2 * p - 1:
        hi *= 2
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_central(mid, df) < 2 * p - 1 else (lo, mid)
    return (lo + hi) / 2


def seeds_needed(sd: float, delta: float = DELTA, alpha: float = 1 - LEVEL, power: float = POWER) -> int:
    """Seeds for a two-sided paired test at level ``alpha`` to detect a mean difference ``delta`` with ``power``:
    ``⌈((z_{1−α/2} + z_{power}) · sd / delta)²⌉`` (normal approximation), at least 2."""
    z = statistics.NormalDist()
    n = ((z.inv_cdf(1 - alpha / 2) + z.inv_cdf(power)) * sd / delta) ** 2
    return max(2, math.ceil(n - 1e-9))


def _signed(x: float) -> str:
    return f"{x:+.3f}".replace("-", "−")


def verdict(a: str, b: str, mean: float, ci: tuple[float, float] | None, n: int) -> str:
    """One sentence from the numbers: ``"<a> − <b>: +0.031 (95% CI −0.012…+0.074, n=6 seeds): not distinguishable"``."""
    head = f"{a} − {b}: {_signed(mean)}"
    if ci is None:
        return f"{head} (n={n} seed{'s' if n != 1 else ''}, no interval): not distinguishable"
    lo, hi = ci
    call = f"{a} beats {b}" if lo > 0 else f"{a} loses to {b}" if hi < 0 else "not distinguishable"
    return f"{head} ({LEVEL:.0%} CI {_signed(lo)}…{_signed(hi)}, n={n} seeds): {call}"


@dataclass(frozen=True)
class PairedComparison:
    a: str
    b: str
    seeds: list[int]  # the seeds both arms finished, ascending
    differences: list[float]  # A − B per seed, in ``seeds`` order
    mean: float
    sd: float | None  # paired SD (n − 1 denominator); None below 2 seeds
    t_ci: tuple[float, float] | None  # the verdict's interval
    bootstrap_ci: tuple[float, float] | None
    seeds_needed: int | None  # to detect DELTA at POWER, from ``sd``
    verdict: str

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "level": LEVEL, "delta": DELTA, "power": POWER, "ci_method": "t"}


def _bootstrap(diffs: Sequence[float], resamples: int, seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    tail = (1 - LEVEL) / 2
    return means[int(tail * resamples)], means[math.ceil((1 - tail) * resamples) - 1]


def paired_comparison(
    a: str,
    a_scores: Mapping[int, float],
    b: str,
    b_scores: Mapping[int, float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    bootstrap_seed: int = BOOTSTRAP_SEED,
) -> PairedComparison:
    """Arm ``a`` against arm ``b`` on the seeds both finished (``{seed: score}`` each, e.g. final exact match)."""
    seeds = sorted(set(a_scores) & set(b_scores))
    if not seeds:
        raise ValueError(f"paired_comparison: {a!r} and {b!r} share no seed; finish a seed of both first.")
    diffs = [a_scores[s] - b_scores[s] for s in seeds]
    n, mean = len(diffs), statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if n > 1 else None
    t_ci = boot = None
    if sd is not None:
        half = t_quantile(1 - (1 - LEVEL) / 2, n - 1) * sd / math.sqrt(n)
        t_ci, boot = (mean - half, mean + half), _bootstrap(diffs, resamples, bootstrap_seed)
    need = seeds_needed(sd) if sd is not None else None
    return PairedComparison(a, b, seeds, diffs, mean, sd, t_ci, boot, need, verdict(a, b, mean, t_ci, n))


def mcnemar(a_correct: Sequence[Sequence[bool]], b_correct: Sequence[Sequence[bool]]) -> dict[str, float]:
    """Per-prompt paired correctness pooled over seeds: ``a_correct[i][j]`` is arm A right on prompt ``j`` in seed
    ``i`` (same prompts, same order for B). Returns the discordant counts ``a_only``/``b_only`` and the exact
    two-sided McNemar p-value ``min(1, 2·P(X ≤ min(a_only, b_only)))``, ``X ~ Binomial(a_only + b_only, ½)``."""
    if len(a_correct) != len(b_correct) or any(len(x) != len(y) for x, y in zip(a_correct, b_correct)):
        raise ValueError(
            "mcnemar: a_correct and b_correct must hold the same seeds and prompts (same shapes)."
        )
    pairs = [(x, y) for xs, ys in zip(a_correct, b_correct) for x, y in zip(xs, ys, strict=True)]
    a_only = sum(x and not y for x, y in pairs)
    b_only = sum(y and not x for x, y in pairs)
    m = a_only + b_only
    tail = sum(math.comb(m, k) for k in range(min(a_only, b_only) + 1)) / 2**m
    return {"a_only": a_only, "b_only": b_only, "pairs": len(pairs), "p_value": min(1.0, 2 * tail)}
