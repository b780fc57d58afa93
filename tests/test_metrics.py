"""Metrics declared once (diffusion_rl/metrics.py): the table every reduction over an update's passes and over the
Ray engine's workers reads (no Ray needed)."""

from __future__ import annotations

import pytest
import torch

import diffusion_rl.algorithms.losses.flow_dppo  # noqa: F401  (declares dppo/kl_max)
import diffusion_rl.algorithms.policy_gradient  # noqa: F401  (declares ratio_min, ratio_max)
import diffusion_rl.algorithms.rollout_correction  # noqa: F401  (declares its max and its shares of entries)
from diffusion_rl.metrics import MAX, MEAN, ROWS, RULES, declare_metrics, reduce_metrics, rule_of
from diffusion_rl.trainer import make_trainer
from diffusion_rl.utils.host_sync import HostReads, Region


def test_each_metric_reduces_by_the_rule_its_component_declared():
    results = [
        {"loss": 1.0, "rollout_corr/abs_dlogp_max": 0.5, "ratio_min": 0.3, "dppo/kl_max": 1.0},
        {"loss": 3.0, "rollout_corr/abs_dlogp_max": 2.0, "ratio_min": 0.1, "dppo/kl_max": 4.0},
        {"loss": 5.0, "rollout_corr/abs_dlogp_max": 1.0, "ratio_min": 0.2, "dppo/kl_max": 2.0},
    ]
    assert reduce_metrics(results) == {
        "loss": 3.0,
        "rollout_corr/abs_dlogp_max": 2.0,
        "ratio_min": 0.1,
        "dppo/kl_max": 4.0,
    }


def test_a_name_ending_in_max_or_min_is_a_mean_unless_declared():
    # the suffix rules are gone: only the table says a metric is an extreme
    reports = [{"toy/x_max": 1.0, "toy/y_min": 4.0}, {"toy/x_max": 3.0, "toy/y_min": 2.0}]
    assert reduce_metrics(reports) == {"toy/x_max": 2.0, "toy/y_min": 3.0}


def test_shares_of_entries_are_weighted_by_the_rows_of_each_pass():
    # passes of 2, 1 and 3 rows with 1/2, 1 and 0 rejected: (1 + 1 + 0) / 6 rows, not the mean of the shares (1/2)
    share, k3 = "rollout_corr/rejected_fraction", "rollout_corr/rejected_fraction/k3"
    passes = [
        {share: 0.5, k3: 0.5, "loss": 1.0},
        {share: 1.0, k3: 1.0, "loss": 2.0},
        {share: 0.0, k3: 0.0, "loss": 6.0},
    ]
    out = reduce_metrics(passes, rows=[2, 1, 3])
    assert out["rollout_corr/rejected_fraction"] == pytest.approx(2 / 6)
    assert out["rollout_corr/rejected_fraction/k3"] == pytest.approx(2 / 6)  # a family declared by its prefix
    assert out["loss"] == 3.0  # a mean is not weighted
    # without rows (the workers' reports, each over as many units) every report weighs alike
    assert reduce_metrics(passes)["rollout_corr/rejected_fraction"] == 0.5


def test_a_metric_keeps_the_one_rule_it_was_declared_with():
    assert rule_of("rollout_corr/rejected_fraction/any_criterion") == ROWS
    assert rule_of("grad_norm") == MEAN
    declare_metrics({"ratio_max": MAX})  # the same rule again: fine
    with pytest.raises(ValueError, match="declared twice"):
        declare_metrics({"ratio_max": MEAN})
    with pytest.raises(ValueError, match="unknown reduction"):
        declare_metrics({"toy/new": "median"})
    assert "toy/new" not in RULES


def test_one_worker_returns_its_metrics_unchanged():
    metrics = {"loss": 0.5, "rollout_corr/abs_dlogp_max": 0.125, "lr": 1e-3}
    assert reduce_metrics([metrics]) == metrics


def test_an_updates_tensor_metrics_are_read_back_in_one_host_read_and_equal_float_of_each():
    # three passes of four metrics as the update loop keeps them (tensors, detached, of several dtypes) and a float
    gen = torch.Generator().manual_seed(0)
    passes = [
        {"loss": torch.randn((), generator=gen), "ratio_max": torch.randn((), generator=gen).to(torch.bfloat16),
         "train/units": torch.tensor(7 + i), "clipped": torch.tensor(i % 2 == 0), "lr": 3e-4}
        for i in range(3)
    ]  # fmt: skip
    with HostReads(within=(Region.of(reduce_metrics),)) as reads:
        out = reduce_metrics(passes, rows=[1, 2, 1])
    assert [r.call for r in reads.seen] == ["tolist"]  # one, not one per metric and pass (12)
    floats = [{name: float(v) for name, v in p.items()} for p in passes]  # the reduction's inputs as they were
    assert out == {
        "loss": sum(f["loss"] for f in floats) / 3,
        "ratio_max": max(f["ratio_max"] for f in floats),
        "train/units": (7.0 + 8.0 + 9.0) / 3,
        "clipped": 2 / 3,
        "lr": 3e-4,
    }
    assert all(type(v) is float for v in out.values())


def test_a_training_steps_metric_assembly_reads_the_device_once(make_config):
    trainer = make_trainer(make_config("train.total_steps=1"))
    with HostReads(within=(Region.of(reduce_metrics),)) as reads:
        metrics = trainer.train_step(0)
    assert len(reads.seen) == 1, "\n".join(map(str, reads.seen))  # a float() per metric and pass before
    assert isinstance(metrics["loss"], float)
