"""The ranked learning benchmark's statistics (benchmarks/ranking_stats.py) against numbers worked out by hand."""

import math

import pytest


@pytest.fixture(scope="module")
def stats(load_benchmark):
    return load_benchmark("ranking_stats")


@pytest.mark.parametrize(
    "dof, expected",  # two-sided 95 % points of Student's t, from the printed tables
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (9, 2.262), (10, 2.228), (30, 2.042)],
)
def test_t_critical_matches_the_printed_table(stats, dof, expected):
    assert stats.t_critical(0.95, dof) == pytest.approx(expected, abs=5e-4)


def test_t_critical_of_one_dof_is_the_cauchy_quantile_and_of_other_levels(stats):
    assert stats.t_critical(0.95, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-9)  # exact for 1 dof
    assert stats.t_critical(0.90, 4) == pytest.approx(2.132, abs=5e-4)
    assert stats.t_critical(0.99, 4) == pytest.approx(4.604, abs=5e-4)
    with pytest.raises(ValueError):
        stats.t_critical(0.95, 0)


def test_interval_of_a_known_sample(stats):
    # 1, 2, 3, 4, 5: mean 3, sd √2.5 = 1.5811, se 0.70711, half width 2.7764 × 0.70711 = 1.9632
    iv = stats.interval([1, 2, 3, 4, 5])
    assert (iv["mean"], iv["n"]) == (3.0, 5)
    assert iv["sd"] == pytest.approx(1.58114, abs=1e-5)
    assert iv["half_width"] == pytest.approx(1.96324, abs=1e-4)
    assert (iv["low"], iv["high"]) == pytest.approx((1.03676, 4.96324), abs=1e-4)
    one = stats.interval([0.5])
    assert one["mean"] == 0.5 and one["half_width"] is None  # one seed: no interval
    assert stats.interval([])["mean"] is None


def test_ranks_overlap_into_ranges_and_a_separated_one_stands_alone(stats):
    intervals = {
        "a": {"mean": 0.60, "low": 0.58, "high": 0.62},
        "b": {"mean": 0.55, "low": 0.50, "high": 0.60},  # overlaps a and c
        "c": {"mean": 0.50, "low": 0.48, "high": 0.52},
        "d": {"mean": 0.30, "low": 0.29, "high": 0.31},  # below everyone
        "none": {"mean": None},
    }
    ranks = stats.rank_with_ties(intervals)
    assert "none" not in ranks
    assert {k: (r["rank"], r["best_rank"], r["worst_rank"]) for k, r in ranks.items()} == {
        "a": (1, 1, 2), "b": (2, 1, 3), "c": (3, 2, 3), "d": (4, 4, 4),
    }  # fmt: skip
    assert ranks["b"]["tied_with"] == ["a", "c"] and ranks["d"]["tied_with"] == []
    assert [stats.rank_label(ranks[k]) for k in "abcd"] == ["1–2", "1–3", "2–3", "4"]


def test_band_interpolates_each_seed_onto_the_common_grid(stats):
    seed0 = [(0.0, 0.0), (10.0, 1.0)]
    seed1 = [(0.0, 0.0), (4.0, 1.0), (8.0, 1.0)]  # the shorter run ends the grid at 8 s
    grid = stats.common_grid([seed0, seed1], points=3)
    assert grid.tolist() == [0.0, 4.0, 8.0]
    points = stats.band([seed0, seed1], grid)
    # at 4 s: 0.4 and 1.0, mean 0.7, sd 0.42426, half width 12.706 × 0.3 = 3.8119
    assert points[1]["mean"] == pytest.approx(0.7)
    assert points[1]["half_width"] == pytest.approx(12.7062 * 0.3, abs=1e-3)
    assert points[2]["mean"] == pytest.approx(0.9)  # 0.8 and 1.0
    assert points[0]["half_width"] == 0.0


def test_validation_standard_error_and_the_images_it_needs(stats):
    # two prompts × 2 samples: 0, 1 | 1, 1 — mean 0.75, sd (n − 1) 0.5, SE 0.5 / 2 = 0.25;
    # within prompts: s² = 0.5 and 0 → √(0.5/2 + 0/2) / 2 = 0.25
    se = stats.validation_se([0.0, 1.0, 1.0, 1.0], per_prompt=2)
    assert (se["n"], se["sd"], se["se"]) == (4, pytest.approx(0.5), pytest.approx(0.25))
    assert se["se_within_prompts"] == pytest.approx(0.25)
    assert stats.validation_se([0.0, 1.0, float("nan"), 1.0], per_prompt=2)["se_within_prompts"] is None
    assert stats.images_for_se(0.3, 0.01) == 900  # (0.3 / 0.01)²
    assert stats.images_for_se(0.301, 0.01) == 907


def test_paired_difference_takes_the_seeds_both_have(stats):
    # common seeds 0, 1, 2: differences 0.05, 0.02, 0.05 — mean 0.04, deviations 0.01, −0.02, 0.01: sd √(0.0006 / 2)
    # = 0.017321, se 0.01, half width t(0.95, 2) · 0.01 = 4.3027 · 0.01
    d = stats.paired_difference({0: 0.50, 1: 0.60, 2: 0.55}, {0: 0.45, 1: 0.58, 2: 0.50, 3: 0.9})
    assert d["seeds"] == [0, 1, 2] and d["differences"] == pytest.approx([0.05, 0.02, 0.05])
    assert (d["mean"], d["sd"]) == (pytest.approx(0.04), pytest.approx(0.0173205, abs=1e-6))
    assert d["half_width"] == pytest.approx(0.043027, abs=1e-5)


def test_paired_ranks_separate_what_independent_intervals_cannot(stats):
    a = {0: 0.50, 1: 0.70, 2: 0.60}
    b = {0: 0.48, 1: 0.67, 2: 0.585}  # a − b: 0.02, 0.03, 0.015 — mean 0.021667, sd 0.0076376, half width 0.018973
    c = {0: 0.30, 1: 0.90, 2: 0.10}  # far from both, but as noisy as its seeds: separated from neither
    # independently a's interval (0.6 ± 0.2484) swallows b's mean; paired, a − b's interval is [0.0027, 0.0406] > 0
    assert stats.interval(list(a.values()))["low"] < 0.5783 < stats.interval(list(a.values()))["high"]
    d = stats.paired_difference(a, b)
    assert (d["low"], d["high"]) == (pytest.approx(0.002694, abs=2e-6), pytest.approx(0.040640, abs=2e-6))
    ranks = stats.rank_paired({"a": a, "b": b, "c": c, "none": {}})
    assert {k: (r["rank"], stats.rank_label(r)) for k, r in ranks.items()} == {
        "a": (1, "1–2"), "b": (2, "2–3"), "c": (3, "1–3"),
    }  # fmt: skip
    assert ranks["a"]["tied_with"] == ["c"]
    # one common seed gives no interval: nothing is separated
    assert stats.rank_label(stats.rank_paired({"a": {0: 1.0}, "b": {0: 0.0, 1: 0.0}})["b"]) == "1–2"


def test_first_crossing_interpolates_between_points(stats):
    xs = [0.0, 0.25, 0.5, 0.75, 1.0]
    assert stats.first_crossing(xs, [0.4, 0.45, 0.5, 0.55, 0.6], 0.52) == pytest.approx(0.6)  # 0.5 + 0.4 · 0.25
    assert stats.first_crossing(xs, [0.4, 0.45, 0.5, 0.55, 0.6], 0.4) == 0.0
    assert stats.first_crossing(xs, [0.4, 0.45, 0.5, 0.55, 0.6], 0.7) is None
    assert stats.first_crossing(xs, [0.4, 0.6, 0.3, 0.3, 0.3], 0.5) == pytest.approx(0.125)  # the first, not the last


def test_compute_to_match_and_its_bootstrap_over_every_resample(stats):
    grid = [0.0, 0.5, 1.0]
    curves = {0: [0.4, 0.5, 0.6], 1: [0.4, 0.7, 0.8]}
    finals = {0: 0.55, 1: 0.65}
    # mean curve 0.4, 0.6, 0.7 reaches the reference's mean 0.6 at 0.5. The 4 resamples of 2 seeds: [0, 0] → target
    # 0.55 on 0.4, 0.5, 0.6: 0.75; [0, 1] and [1, 0] → 0.5; [1, 1] → 0.65 on 0.4, 0.7, 0.8: 0.25/0.3 · 0.5 = 5/12
    every = [[0, 0], [0, 1], [1, 0], [1, 1]]
    c = stats.compute_to_match(curves, finals, grid, resamples=every)
    assert c["value"] == pytest.approx(0.5)
    assert (c["low"], c["high"]) == (pytest.approx(5 / 12), pytest.approx(0.75))
    # a resample that never reaches its target is beyond the grid: the interval opens upwards
    slow = stats.compute_to_match({0: [0.4, 0.45, 0.5], 1: [0.4, 0.7, 0.8]}, finals, grid, resamples=every)
    assert slow["value"] == pytest.approx(0.5 + 0.025 / 0.075 * 0.5)  # mean 0.4, 0.575, 0.65 to 0.6
    assert slow["high"] == math.inf


def test_the_bootstrap_interval_is_the_order_statistics_of_a_plain_loop(stats):
    grid = [0.0, 0.5, 1.0]
    curves = {0: [0.40, 0.50, 0.60], 1: [0.40, 0.70, 0.80], 2: [0.41, 0.52, 0.58], 3: [0.39, 0.61, 0.66]}
    finals = {0: 0.55, 1: 0.65, 2: 0.60, 3: 0.58}
    c = stats.compute_to_match(curves, finals, grid)
    reps = []
    for draw in stats.bootstrap_resamples(4):  # the same draws, crossed by hand
        mean = [sum(curves[int(i)][k] for i in draw) / 4 for k in range(3)]
        target = sum(finals[int(i)] for i in draw) / 4
        hit = math.inf
        for k in range(3):
            if mean[k] >= target:
                hit = 0.0 if k == 0 else grid[k - 1] + (target - mean[k - 1]) / (mean[k] - mean[k - 1]) * 0.5
                break
        reps.append(hit)
    reps.sort()
    count = len(reps)
    assert count == 2000 and c["replicates"] == count
    assert c["low"] == pytest.approx(reps[math.ceil(0.025 * count) - 1])  # the smallest value with F ≥ 2.5 %
    assert c["high"] == pytest.approx(reps[math.ceil(0.975 * count) - 1])
    assert c["low"] <= c["value"] <= c["high"]
