"""train/weight_change_rel: |Δθ| / |θ| of each optimizer step, against the weights read before and after it."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_rl.config.train import TrainConfig
from diffusion_rl.engine.optimizer import OptimizerStepper
from diffusion_rl.engine.parallel import SingleDevice


def _weights() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]


def test_the_relative_change_is_the_norm_of_the_step_over_the_norm_before_it():
    weights = _weights()
    stepper = OptimizerStepper(weights, TrainConfig(lr=0.05, grad_clip=0, weight_decay=0.01), SingleDevice(), "on")
    expected, grad_norms = [], []
    for _ in range(3):
        sum((w**3).sum() for w in weights).backward()
        grad_norms.append(math.sqrt(sum((w.grad**2).sum().item() for w in weights)))
        before = [w.detach().clone() for w in weights]
        stepper.step()
        delta = sum(((w.detach() - b) ** 2).sum().item() for w, b in zip(weights, before))
        norm = sum((b**2).sum().item() for b in before)
        expected.append(math.sqrt(delta) / math.sqrt(norm))
    metrics = stepper.metrics()
    assert metrics["train/weight_change_rel"] == pytest.approx(sum(expected) / 3, rel=1e-6)
    assert metrics["grad_norm"] == pytest.approx(sum(grad_norms) / 3, rel=1e-6)  # the stepper's own record
    assert metrics["train/optimizer_steps"] == 3 and metrics["lr"] == 0.05
    assert expected[0] > 0
    after = stepper.metrics()  # measured per update: reset after reporting
    assert "train/weight_change_rel" not in after and math.isnan(after["grad_norm"])


def test_a_skipped_step_changes_nothing_and_is_not_counted():
    weights = _weights()
    stepper = OptimizerStepper(weights, TrainConfig(lr=0.05, grad_clip=1.0), SingleDevice(), "on")
    weights[0].grad = torch.full_like(weights[0], float("nan"))
    stepper.step()
    metrics = stepper.metrics()
    assert "train/weight_change_rel" not in metrics and math.isnan(metrics["grad_norm"])
    assert metrics["train/skipped_updates"] == 1 and metrics["train/optimizer_steps"] == 0


@pytest.mark.parametrize(("setting", "measured"), [("auto", True), ("off", False), ("on", True)])
def test_auto_measures_small_models_only(setting, measured, monkeypatch):
    weights = _weights()
    assert OptimizerStepper(weights, TrainConfig(), SingleDevice(), setting).measure_change is measured
    monkeypatch.setattr("diffusion_rl.engine.optimizer.WEIGHT_CHANGE_AUTO_MAX", 5)  # these weights hold 10
    assert OptimizerStepper(weights, TrainConfig(), SingleDevice(), "auto").measure_change is False
