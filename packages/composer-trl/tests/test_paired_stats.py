"""bench/paired_stats.py: the paired-over-seeds statistics behind the comparison's verdicts, against values
computed by hand (t quantiles from the standard table, means/SDs/intervals in closed form)."""

from __future__ import annotations

import math
from typing import Any

import pytest


@pytest.mark.parametrize(
    ("p", "df", "want"),
    [(0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 3, 3.1824), (0.975, 5, 2.5706), (0.975, 30, 2.0423),
     (0.8, 1, 1.3764), (0.8, 5, 0.9195)],
)  # fmt: skip
def test_t_quantile_matches_the_table(paired_stats: Any, p: float, df: int, want: float) -> None:
    assert paired_stats.t_quantile(p, df) == pytest.approx(want, abs=1e-4)


def test_t_quantile_exact_where_the_cdf_inverts_by_hand(paired_stats: Any) -> None:
    # df = 1 is Cauchy: quantile tan(π(p − ½)); df = 2: t = (2p − 1)·√(2 / (1 − (2p − 1)²))
    assert paired_stats.t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-10)
    assert paired_stats.t_quantile(0.975, 2) == pytest.approx(0.95 * math.sqrt(2 / (1 - 0.95**2)), rel=1e-10)
    with pytest.raises(ValueError, match=r"0\.5 < p < 1"):
        paired_stats.t_quantile(0.4, 3)


def test_paired_difference_mean_sd_and_t_interval_in_closed_form(paired_stats: Any) -> None:
    a = {0: 0.5, 1: 0.4, 2: 0.6, 3: 0.7, 9: 1.0}  # seed 9: A only, left out
    b = {0: 0.3, 1: 0.4, 2: 0.5, 3: 0.4}
    c = paired_stats.paired_comparison("composer", a, "grpo", b)
    assert c.seeds == [0, 1, 2, 3]
    assert c.differences == pytest.approx([0.2, 0.0, 0.1, 0.3])
    assert c.mean == pytest.approx(0.15)
    sd = math.sqrt(0.05 / 3)  # squared deviations 0.0025 + 0.0225 + 0.0025 + 0.0225 over n − 1
    assert c.sd == pytest.approx(sd)
    half = 3.182446 * sd / 2
    assert c.t_ci == pytest.approx((0.15 - half, 0.15 + half), abs=1e-6)
    assert c.verdict == "composer − grpo: +0.150 (95% CI −0.055…+0.355, n=4 seeds): not distinguishable"
    assert c.seeds_needed == math.ceil((2.8015849 * sd / 0.05) ** 2)  # 22
    assert c.as_dict()["ci_method"] == "t"


def test_verdict_says_beats_or_loses_only_when_the_interval_excludes_zero(paired_stats: Any) -> None:
    b = dict.fromkeys(range(5), 0.2)
    up = {s: 0.2 + d for s, d in enumerate([0.1, 0.12, 0.14, 0.16, 0.18])}
    c = paired_stats.paired_comparison("A", up, "B", b)
    half = 2.776445 * math.sqrt(0.001) / math.sqrt(5)  # mean 0.14, sd √0.001
    assert c.t_ci == pytest.approx((0.14 - half, 0.14 + half), abs=1e-6)
    assert c.verdict == "A − B: +0.140 (95% CI +0.101…+0.179, n=5 seeds): A beats B"
    down = paired_stats.paired_comparison("B", b, "A", up)
    assert down.verdict == "B − A: −0.140 (95% CI −0.179…−0.101, n=5 seeds): B loses to A"


def test_bootstrap_is_fixed_seeded_and_matches_its_exact_distribution(paired_stats: Any) -> None:
    # two seeds, differences 0 and 1: resampled means 0, ½, 1 with probability ¼, ½, ¼ → 2.5 % / 97.5 % at 0 and 1
    c = paired_stats.paired_comparison("A", {0: 0.0, 1: 1.0}, "B", {0: 0.0, 1: 0.0})
    assert c.bootstrap_ci == (0.0, 1.0)
    flat = paired_stats.paired_comparison(
        "A", dict.fromkeys(range(3), 0.4), "B", dict.fromkeys(range(3), 0.3)
    )
    assert flat.bootstrap_ci == pytest.approx((0.1, 0.1)) and flat.sd == pytest.approx(0.0, abs=1e-12)
    again = paired_stats.paired_comparison("A", {0: 0.5, 1: 0.1, 2: 0.3}, "B", {0: 0.2, 1: 0.2, 2: 0.2})
    assert (
        again.bootstrap_ci
        == paired_stats.paired_comparison(
            "A", {0: 0.5, 1: 0.1, 2: 0.3}, "B", {0: 0.2, 1: 0.2, 2: 0.2}
        ).bootstrap_ci
    )


def test_seeds_needed_is_the_normal_power_formula(paired_stats: Any) -> None:
    # ((z_0.975 + z_0.8) · sd / δ)² with z_0.975 = 1.959964, z_0.8 = 0.841621: the 0.19 → 113.3 → 114
    assert paired_stats.seeds_needed(0.19) == 114
    assert paired_stats.seeds_needed(0.05) == 8  # 2.801585² = 7.85
    assert paired_stats.seeds_needed(0.0) == 2


def test_one_seed_gives_no_interval_and_no_shared_seed_is_an_error(paired_stats: Any) -> None:
    c = paired_stats.paired_comparison("A", {0: 0.5}, "B", {0: 0.25, 1: 0.5})
    assert (c.sd, c.t_ci, c.seeds_needed) == (None, None, None)
    assert c.verdict == "A − B: +0.250 (n=1 seed, no interval): not distinguishable"
    with pytest.raises(ValueError, match="share no seed"):
        paired_stats.paired_comparison("A", {0: 0.5}, "B", {1: 0.5})


def test_mcnemar_counts_discordant_prompts_and_gives_the_exact_binomial_p(paired_stats: Any) -> None:
    a = [[True, True, True, False], [True, True, False, False]]
    b = [[False, True, False, False], [False, True, False, False]]
    r = paired_stats.mcnemar(a, b)
    assert (r["a_only"], r["b_only"], r["pairs"]) == (3, 0, 8)
    assert r["p_value"] == pytest.approx(2 / 8)  # 2 · P(X ≤ 0), X ~ Bin(3, ½)
    assert paired_stats.mcnemar([[True, False]], [[False, True]])["p_value"] == 1.0
    with pytest.raises(ValueError, match="same shapes"):
        paired_stats.mcnemar([[True]], [[True, False]])
