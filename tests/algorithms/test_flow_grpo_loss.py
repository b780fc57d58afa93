import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.policy_gradient import PolicyLossInput
from diffusion_rl.config.plugins import LOSSES

CLIP = 0.2
# Sample 0: ratio e^0.1 inside the clip range. Sample 1: ratio e^0.5 above it with A > 0 (clipped at 1.2).
# Sample 2: ratio e^-0.5 below it with A < 0 (clipped at 0.8).
LOG_RATIOS = [0.1, 0.5, -0.5]
ADVANTAGES = [1.0, 2.0, -1.5]


def _cfg(clip_range=CLIP, adv_clip_max=5.0, kl_beta=0.0):
    return SimpleNamespace(clip_range=clip_range, adv_clip_max=adv_clip_max, kl_beta=kl_beta)


def _input(advantages=ADVANTAGES, log_ratios=LOG_RATIOS, ref_mean=None, std=None, weights=None, mean=None):
    old = torch.tensor([-1.0, -2.0, -3.0])
    log_prob = (old + torch.tensor(log_ratios)).requires_grad_(True)
    mean = torch.zeros(3, 2, 2) if mean is None else mean
    return PolicyLossInput(
        log_prob=log_prob,
        old_log_prob=old,
        advantages=torch.tensor(advantages),
        mean=mean,
        old_mean=torch.zeros(3, 2, 2),
        ref_mean=ref_mean,
        std=torch.tensor([0.5, 1.0, 2.0]) if std is None else std,
        sqrt_dt=torch.full((3,), 0.1),
        weights=weights,
    )


def _hand_policy_terms(advantages, log_ratios, clip=CLIP):
    terms = []
    for a, lr in zip(advantages, log_ratios):
        ratio = math.exp(lr)
        clipped_ratio = min(max(ratio, 1 - clip), 1 + clip)
        terms.append(max(-a * ratio, -a * clipped_ratio))
    return terms


def test_policy_loss_matches_hand_computation():
    out = LOSSES.get("flow_grpo")(_input(), _cfg())
    # By hand: -1 * e^0.1, -2 * 1.2, +1.5 * 0.8
    expected_terms = [-math.exp(0.1), -2.4, 1.2]
    assert _hand_policy_terms(ADVANTAGES, LOG_RATIOS) == pytest.approx(expected_terms)
    assert out.loss.item() == pytest.approx(sum(expected_terms) / 3, rel=1e-6)
    assert out.metrics["policy_loss"].item() == pytest.approx(sum(expected_terms) / 3, rel=1e-6)
    assert out.metrics["kl_ref"].item() == 0.0


def test_gradient_is_zero_for_clipped_samples():
    inp = _input()
    out = LOSSES.get("flow_grpo")(inp, _cfg())
    out.loss.backward()
    grad = inp.log_prob.grad.tolist()
    # d/dlog_prob of -A * exp(log_prob - old) / B for the unclipped sample
    assert grad[0] == pytest.approx(-1.0 * math.exp(0.1) / 3, rel=1e-6)
    assert grad[1] == 0.0
    assert grad[2] == 0.0


def test_pessimistic_bound_keeps_gradient_outside_clip_when_it_hurts():
    # A > 0 with the ratio below 1 - clip: the unclipped term is the larger one and keeps its gradient.
    inp = _input(advantages=[1.0, 1.0, 1.0], log_ratios=[-0.5, 0.0, 0.0])
    LOSSES.get("flow_grpo")(inp, _cfg()).loss.backward()
    assert inp.log_prob.grad[0].item() == pytest.approx(-math.exp(-0.5) / 3, rel=1e-6)


def test_metrics_match_hand_computation():
    out = LOSSES.get("flow_grpo")(_input(), _cfg())
    ratios = [math.exp(x) for x in LOG_RATIOS]
    mean_ratio = sum(ratios) / 3
    assert out.metrics["clip_fraction"].item() == pytest.approx(2 / 3)
    assert out.metrics["approx_kl"].item() == pytest.approx(0.5 * sum(x * x for x in LOG_RATIOS) / 3)
    assert out.metrics["ratio_mean"].item() == pytest.approx(mean_ratio)
    assert out.metrics["ratio_std"].item() == pytest.approx(math.sqrt(sum((r - mean_ratio) ** 2 for r in ratios) / 3))
    assert all(not v.requires_grad and v.ndim == 0 for v in out.metrics.values())


def test_advantages_are_clamped():
    out = LOSSES.get("flow_grpo")(_input(advantages=[10.0, 2.0, -7.0]), _cfg(adv_clip_max=1.5))
    expected = _hand_policy_terms([1.5, 1.5, -1.5], LOG_RATIOS)
    assert out.loss.item() == pytest.approx(sum(expected) / 3, rel=1e-6)


def test_kl_to_reference_and_weights():
    mean = torch.tensor(
        [
            [[0.1, 0.2], [0.3, 0.4]],
            [[1.0, -1.0], [0.5, 0.0]],
            [[2.0, 2.0], [2.0, 2.0]],
        ]
    ).requires_grad_(True)
    ref = torch.tensor(
        [
            [[0.0, 0.0], [0.0, 0.0]],
            [[0.0, 0.0], [0.0, 0.0]],
            [[1.0, 1.0], [1.0, 1.0]],
        ]
    )
    std = [0.5, 1.0, 2.0]
    weights = [1.0, 0.5, 2.0]
    beta = 0.1
    inp = _input(mean=mean, ref_mean=ref, std=torch.tensor(std), weights=torch.tensor(weights))
    out = LOSSES.get("flow_grpo")(inp, _cfg(kl_beta=beta))

    kl = []
    for i in range(3):
        diffs = [(mean[i, a, b].item() - ref[i, a, b].item()) ** 2 for a in range(2) for b in range(2)]
        kl.append(sum(diffs) / 4 / (2 * std[i] ** 2))
    # (0.01+0.04+0.09+0.16)/4 / 0.5 = 0.15;  (1+1+0.25)/4 / 2 = 0.28125;  1 / 8 = 0.125
    assert kl == pytest.approx([0.15, 0.28125, 0.125])
    policy = _hand_policy_terms(ADVANTAGES, LOG_RATIOS)
    expected = sum(w * (p + beta * k) for w, p, k in zip(weights, policy, kl)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.metrics["kl_ref"].item() == pytest.approx(sum(kl) / 3)
    out.loss.backward()
    # d/dmean of w * beta * mean((m - ref)^2) / (2 std^2) / B at sample 2, element 0: w=2, m-ref=1, std^2=4
    assert mean.grad[2, 0, 0].item() == pytest.approx(2.0 * beta * 2.0 * 1.0 / 4 / (2 * 4.0) / 3)


def test_kl_without_reference_mean_is_an_error():
    with pytest.raises(ValueError, match="ref_mean"):
        LOSSES.get("flow_grpo")(_input(), _cfg(kl_beta=0.04))
