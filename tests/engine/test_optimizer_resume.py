"""A restored optimizer takes the resuming config's hyper-parameters (engine/optimizer.py), its moments kept."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from diffusion_rl.config.train import TrainConfig
from diffusion_rl.engine.optimizer import OptimizerStepper, apply_train_hyperparameters
from diffusion_rl.engine.parallel import SingleDevice


def _stepper(train: TrainConfig, steps: int = 0) -> tuple[OptimizerStepper, torch.nn.Parameter]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3))
    stepper = OptimizerStepper([weight], train, SingleDevice())
    for _ in range(steps):
        (weight**2).sum().backward()
        stepper.step()
    return stepper, weight


def test_a_restored_optimizer_takes_the_new_settings_and_keeps_its_moments(caplog):
    saved_cfg = TrainConfig(lr=1e-2, warmup_steps=4, betas=(0.9, 0.999), weight_decay=1e-4, grad_clip=0)
    saved, _ = _stepper(saved_cfg, steps=2)
    new_cfg = dataclasses.replace(saved_cfg, lr=5e-3, warmup_steps=8, betas=(0.8, 0.99), weight_decay=0.0)
    resumed, _ = _stepper(new_cfg)
    resumed.optimizer.load_state_dict(saved.optimizer.state_dict())  # what a checkpoint restores
    resumed.load_counters_state(saved.counters_state())
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 3 / 4)  # the saved schedule, n = 2

    with caplog.at_level(logging.INFO, logger="diffusion_rl"):
        apply_train_hyperparameters(resumed.optimizer, resumed.scheduler, new_cfg)
    group = resumed.optimizer.param_groups[0]
    # step 2 of an 8-step warm-up at 5e-3: LambdaLR's lr is base · min(1, (n + 1) / warmup) with n = 2
    assert group["lr"] == pytest.approx(5e-3 * 3 / 8, rel=1e-12)
    assert resumed.metrics()["lr"] == group["lr"]
    assert group["betas"] == (0.8, 0.99) and group["weight_decay"] == 0.0 and group["initial_lr"] == 5e-3
    saved_state = next(iter(saved.optimizer.state.values()))
    kept = next(iter(resumed.optimizer.state.values()))
    assert torch.equal(kept["exp_avg"], saved_state["exp_avg"]) and torch.equal(kept["step"], saved_state["step"])
    (said,) = [r.getMessage() for r in caplog.records]
    assert "lr 0.01 → 0.005" in said and "betas (0.9, 0.999) → (0.8, 0.99)" in said and "eps" not in said

    resumed.scheduler.step()  # the schedule goes on from there: step 3 of the new warm-up
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3 * 4 / 8, rel=1e-12)
