"""Formulas of the pretraining objective, checked against numbers worked out by hand."""

import math

import pytest
import torch

from diffusion_rl.pretrain.flow_matching import (
    cosine_lr_factor,
    flow_matching_loss,
    logit_normal_sigmas,
    noisy_latents,
)


def test_noisy_latents_interpolate_per_row():
    x0 = torch.tensor([[2.0, -1.0], [4.0, 0.0]])
    noise = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    sigma = torch.tensor([0.25, 1.0])
    # row 0: 0.75·x0 + 0.25·ε = [1.5, -0.5]; row 1: pure noise
    assert noisy_latents(x0, noise, sigma).tolist() == [[1.5, -0.5], [1.0, 1.0]]


def test_flow_matching_loss_is_the_mean_squared_velocity_error():
    x0 = torch.tensor([[1.0, 2.0]])
    noise = torch.tensor([[0.0, 0.0]])
    v = torch.tensor([[0.0, 0.0]])  # target ε − x0 = [-1, -2]: squared errors 1 and 4
    assert flow_matching_loss(v, x0, noise).item() == pytest.approx(2.5)


def test_logit_normal_sigmas_are_sigmoids_of_shifted_normals():
    g = torch.Generator().manual_seed(7)
    sigmas = logit_normal_sigmas(5, mean=0.5, std=2.0, generator=g)
    z = torch.randn(5, generator=torch.Generator().manual_seed(7)).tolist()
    expected = [1 / (1 + math.exp(-(0.5 + 2.0 * zi))) for zi in z]
    assert sigmas.tolist() == pytest.approx(expected, rel=1e-6)
    assert ((sigmas > 0) & (sigmas < 1)).all()


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    # warm-up: (k + 1) / 10; then 0.1 + 0.9 · (1 + cos(π · (k − 10) / 90)) / 2
    assert cosine_lr_factor(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert cosine_lr_factor(9, 100, 10, 0.1) == pytest.approx(1.0)
    assert cosine_lr_factor(10, 100, 10, 0.1) == pytest.approx(1.0)
    assert cosine_lr_factor(55, 100, 10, 0.1) == pytest.approx(0.55)  # half-way: 0.1 + 0.9 · 0.5
    assert cosine_lr_factor(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert cosine_lr_factor(500, 100, 10, 0.1) == pytest.approx(0.1)
