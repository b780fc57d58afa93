"""mean@K, best@K and std of K scores per prompt, with numbers worked out by hand; the comparison table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diffusion_rl.evaluation import comparison_table, reward_stats, score_stats

NAN = float("nan")


def test_stats_of_two_samples_per_prompt_with_failures():
    # prompt 0: 1, 3; prompt 1: failed, 2; prompt 2: both failed
    stats = score_stats(np.array([[1.0, 3.0], [NAN, 2.0], [NAN, NAN]]))
    assert stats["mean@2"] == pytest.approx(2.0)  # (1 + 3 + 2) / 3
    assert stats["best@2"] == pytest.approx(2.5)  # (3 + 2) / 2: prompt 2 has no best
    assert stats["std"] == pytest.approx(math.sqrt(2 / 3))  # ((1-2)² + (3-2)² + 0²) / 3
    assert (stats["scored"], stats["failed"]) == (3, 3)


def test_all_failed_gives_none_not_zero():
    stats = score_stats(np.full((2, 3), NAN))
    assert stats["mean@3"] is None and stats["best@3"] is None and stats["std"] is None


def test_per_source_statistics_split_the_prompts():
    stats = reward_stats(np.array([[1.0, 2.0], [10.0, 20.0], [3.0, 4.0]]), ["a", "b", "a"])
    assert stats["mean@2"] == pytest.approx(40 / 6)
    assert stats["per_source"]["a"]["mean@2"] == pytest.approx(2.5)  # (1 + 2 + 3 + 4) / 4
    assert stats["per_source"]["a"]["best@2"] == pytest.approx(3.0)  # (2 + 4) / 2
    assert stats["per_source"]["b"]["best@2"] == pytest.approx(20.0)


def test_comparison_table_has_a_column_per_model_and_source_rows_for_several_sources():
    def column(name, offset):
        return {"name": name, "rewards": {"r": reward_stats(np.array([[1.0, 2.0], [3.0, NAN]]) + offset, ["x", "y"])}}

    table = comparison_table([column("base", 0.0), column("step_000010", 1.0)], k=2)
    lines = table.splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["metric", "base", "step_000010"]
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:]}
    assert cells["r mean@2"] == ["2", "3"]
    assert cells["r best@2"] == ["2.5", "3.5"]  # (2 + 3) / 2
    assert cells["r failed"] == ["1", "1"]
    assert cells["r [y] mean@2"] == ["3", "4"]
