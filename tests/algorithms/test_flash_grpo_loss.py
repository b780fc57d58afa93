"""Flash-GRPO: the rectification coefficient of a step, the weighted PPO-clip loss, and the one-step draw, against
plain-Python numbers."""

import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.losses.flash_grpo import step_coefficients
from diffusion_rl.algorithms.policy_gradient import PolicyLossInput
from diffusion_rl.config.plugins import LOSSES
from diffusion_rl.sampling.window import window_for_step

NOISE = 0.7
STEPS = [(1.0, 0.9), (0.9, 0.5), (0.5, 0.2), (0.2, 0.1)]  # (σ, σ_next); the first from pure noise


def hand_coefficient(sigma: float, sigma_next: float) -> float:
    """Flow-GRPO's sde step written out: std = a·√(σ/(1 − σ̃)) (σ̃ = σ_next at σ = 1), noise std std·√dt,
    ∂mean/∂v = (1 + std²(1 − σ)/(2σ))·dt; c = noise std / |∂mean/∂v| (the authors' `coe`, with their std)."""
    tilde = sigma_next if sigma == 1 else sigma
    std = NOISE * math.sqrt(sigma / (1 - tilde))
    dt = sigma - sigma_next
    return std * math.sqrt(dt) / ((1 + std**2 * (1 - sigma) / (2 * sigma)) * dt)


def test_step_coefficient_is_the_noise_std_over_the_mean_s_velocity_slope():
    # by hand: step 0: 0.7·√10 · √0.1 / 0.1 = 7.0; step 1: 2.1·√0.4 / (1.245·0.4) = 1.328157 / 0.498 = 2.66698
    got = step_coefficients(torch.tensor([s for s, _ in STEPS]), torch.tensor([n for _, n in STEPS]), "sde", NOISE)
    assert got.tolist() == pytest.approx([hand_coefficient(s, n) for s, n in STEPS], rel=1e-5)
    assert got[:2].tolist() == pytest.approx([7.0, 2.66698], rel=1e-5)
    # early steps' log-probs have the smaller gradient, so they get the larger weight
    assert got[0] > got[1] > got[2]


CLIP = 1e-3
LOG_RATIOS = [0.0005, 0.01, -0.02, 0.0]  # inside the clip; above it with A > 0; below it with A < 0; on-policy
ADVANTAGES = [1.5, 2.0, -6.0, 0.5]  # the third is clamped to −5


def test_loss_is_flow_grpo_s_clipped_term_weighted_by_the_rectification_weight():
    coefficients = [hand_coefficient(s, n) for s, n in STEPS]
    mean_c = sum(coefficients) / len(coefficients)
    weights = [c / mean_c for c in coefficients]
    old = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    inp = PolicyLossInput(
        log_prob=(old + torch.tensor(LOG_RATIOS)).requires_grad_(True), old_log_prob=old,
        advantages=torch.tensor(ADVANTAGES), mean=torch.zeros(4, 2), old_mean=torch.zeros(4, 2), ref_mean=None,
        std=torch.ones(4), sqrt_dt=torch.ones(4), weights=torch.tensor(weights),
    )  # fmt: skip
    out = LOSSES.get("flash_grpo")(inp, SimpleNamespace(clip_range=CLIP, adv_clip_max=5.0, kl_beta=0.0))
    terms = []
    for lr, a, w in zip(LOG_RATIOS, ADVANTAGES, weights):
        a, r = min(max(a, -5.0), 5.0), math.exp(lr)
        terms.append(w * max(-a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP)))
    assert out.loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-6)
    # the gradient: d/d log_prob_i of w_i·(−A_i·r_i)/B where the ratio is not clipped, 0 where it is
    out.loss.backward()
    expected = [-w * a * math.exp(lr) / 4 if abs(math.exp(lr) - 1) <= CLIP else 0.0
                for lr, a, w in zip(LOG_RATIOS, ADVANTAGES, weights)]  # fmt: skip
    assert inp.log_prob.grad.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_the_one_trained_step_is_drawn_uniformly_from_lo_to_hi_and_is_one_per_training_step():
    window = SimpleNamespace(kind="random", size=1, lo=0, hi=5)
    sampling = SimpleNamespace(sde_type="sde", num_steps=10, window=window)
    draws = [window_for_step(sampling, 0, step) for step in range(400)]
    assert {w.size for w in draws} == {1}
    counts = [sum(w.start == k for w in draws) for k in range(10)]
    assert counts[5:] == [0] * 5 and min(counts[:5]) > 50, counts  # 80 expected each
