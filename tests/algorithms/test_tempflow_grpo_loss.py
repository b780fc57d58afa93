"""TempFlow-GRPO's loss: the noise-aware weight and the weighted PPO-clip term against plain-Python numbers."""

import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.losses.tempflow_grpo import noise_aware_weight
from diffusion_rl.algorithms.policy_gradient import PolicyLossInput
from diffusion_rl.config.plugins import LOSSES

CLIP = 0.05
# Flow-GRPO's std at sigma 0.8 and 0.4 (noise level 0.7): 0.7·√(σ/(1 − σ)); √dt of steps of 0.2 and 0.1.
SIGMAS = [0.8, 0.4, 0.4]
SQRT_DT = [math.sqrt(0.2), math.sqrt(0.1), math.sqrt(0.1)]
STD = [0.7 * math.sqrt(s / (1 - s)) for s in SIGMAS]
LOG_RATIOS = [0.01, 0.2, -0.3]  # inside the clip; above it with A > 0 (clipped); below it with A < 0 (clipped)
ADVANTAGES = [1.5, 2.0, -6.0]  # the last is clamped to -5


def _cfg(noise_aware=True, scale=2.25, kl_beta=0.0):
    return SimpleNamespace(clip_range=CLIP, adv_clip_max=5.0, kl_beta=kl_beta, noise_aware=noise_aware,
                           noise_weight_scale=scale)  # fmt: skip


def _input(weights=None, ref_mean=None):
    old = torch.tensor([-1.0, -2.0, -3.0])
    return PolicyLossInput(
        log_prob=(old + torch.tensor(LOG_RATIOS)).requires_grad_(True),
        old_log_prob=old,
        advantages=torch.tensor(ADVANTAGES),
        mean=torch.tensor([[0.2, 0.0], [0.1, 0.1], [0.0, -0.3]]).requires_grad_(True),
        old_mean=torch.zeros(3, 2),
        ref_mean=ref_mean,
        std=torch.tensor(STD),
        sqrt_dt=torch.tensor(SQRT_DT),
        weights=weights,
    )


def _hand_terms(noise_aware=True, scale=2.25):
    terms = []
    for lr, a, std, sdt in zip(LOG_RATIOS, ADVANTAGES, STD, SQRT_DT):
        a = min(max(a, -5.0), 5.0)
        r = math.exp(lr)
        w = scale * std * sdt if noise_aware else 1.0
        terms.append(w * max(-a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP)))
    return terms


def test_noise_aware_weight_is_the_scaled_noise_std_of_the_step():
    # by hand: 2.25 · 0.7·√(0.8/0.2) · √0.2 = 2.25 · 1.4 · 0.4472 = 1.40872; 2.25 · 0.7·√(0.4/0.6) · √0.1 = 0.40666
    got = noise_aware_weight(torch.tensor(STD), torch.tensor(SQRT_DT), 2.25)
    assert got.tolist() == pytest.approx([1.408721, 0.406663, 0.406663], abs=1e-5)
    # the early (noisier) step weighs more than the late one
    assert got[0] > got[1]


def test_loss_matches_a_plain_python_computation():
    out = LOSSES.get("tempflow_grpo").fn(_input(), _cfg())
    terms = _hand_terms()
    assert float(out.loss.detach()) == pytest.approx(sum(terms) / 3, rel=1e-5)
    assert float(out.metrics["policy_loss"]) == pytest.approx(sum(terms) / 3, rel=1e-5)
    weights = [2.25 * s * d for s, d in zip(STD, SQRT_DT)]
    assert float(out.metrics["tempflow/noise_weight"]) == pytest.approx(sum(weights) / 3, rel=1e-5)
    assert float(out.metrics["clip_fraction"]) == pytest.approx(2 / 3)


def test_clipped_samples_carry_no_gradient_and_the_kept_one_is_weighted():
    inp = _input()
    LOSSES.get("tempflow_grpo").fn(inp, _cfg()).loss.backward()
    w0 = 2.25 * STD[0] * SQRT_DT[0]
    # d/dlog_prob of w·(−A·e^lr)/3 for sample 0; samples 1 and 2 are clipped on the side that stops the gradient
    assert inp.log_prob.grad.tolist() == pytest.approx([-w0 * 1.5 * math.exp(0.01) / 3, 0.0, 0.0], abs=1e-6)


def test_without_noise_awareness_it_is_flow_grpo():
    inp = _input()
    out = LOSSES.get("tempflow_grpo").fn(inp, _cfg(noise_aware=False))
    ref = LOSSES.get("flow_grpo").fn(_input(), _cfg())
    assert float(out.loss.detach()) == pytest.approx(sum(_hand_terms(noise_aware=False)) / 3, rel=1e-5)
    assert float(out.loss.detach()) == pytest.approx(float(ref.loss.detach()), rel=1e-6)


def test_rollout_weights_multiply_and_kl_is_not_noise_weighted():
    weights = torch.tensor([1.0, 0.0, 0.5])
    ref_mean = torch.zeros(3, 2)
    out = LOSSES.get("tempflow_grpo").fn(_input(weights=weights, ref_mean=ref_mean), _cfg(kl_beta=0.1))
    sq = [(0.04 + 0.0) / 2, (0.01 + 0.01) / 2, (0.0 + 0.09) / 2]
    kl = [m / (2 * s * s) for m, s in zip(sq, STD)]
    expected = sum(w * (t + 0.1 * k) for w, t, k in zip([1.0, 0.0, 0.5], _hand_terms(), kl)) / 3
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-5)
