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
