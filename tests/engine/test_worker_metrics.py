"""The one rule that reduces metrics over an update's passes and over the Ray engine's workers (no Ray needed)."""

from __future__ import annotations

from diffusion_rl.engine.worker import reduce_metrics


def test_max_metrics_take_the_max_min_metrics_the_min_and_the_rest_the_mean():
    results = [
        {"loss": 1.0, "rollout_corr/abs_dlogp_max": 0.5, "x_min": 0.3, "rollout_corr/rejected_fraction": 0.25},
        {"loss": 3.0, "rollout_corr/abs_dlogp_max": 2.0, "x_min": 0.1, "rollout_corr/rejected_fraction": 0.5},
        {"loss": 5.0, "rollout_corr/abs_dlogp_max": 1.0, "x_min": 0.2, "rollout_corr/rejected_fraction": 0.0},
    ]
    assert reduce_metrics(results) == {
        "loss": 3.0,
        "rollout_corr/abs_dlogp_max": 2.0,
        "x_min": 0.1,
        "rollout_corr/rejected_fraction": 0.25,
    }


def test_one_worker_returns_its_metrics_unchanged():
    metrics = {"loss": 0.5, "rollout_corr/abs_dlogp_max": 0.125, "lr": 1e-3}
    assert reduce_metrics([metrics]) == metrics
