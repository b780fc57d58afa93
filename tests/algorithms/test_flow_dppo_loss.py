import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.losses.flow_dppo import FlowDppoSettings
from diffusion_rl.algorithms.policy_gradient import PolicyLossInput
from diffusion_rl.config.plugins import LOSSES

THRESHOLD = 1e-3
STD = [1.0, 0.5, 2.0]
SQRT_DT = [0.1, 0.2, 0.1]  # noise std std * sqrt_dt: 0.1, 0.1, 0.2
# Sample 0: KL 1e-4 / (2 * 0.01) = 0.005 >= threshold, ratio e^0.2 > 1 with A > 0: widening, masked.
# Sample 1: KL 0.005 >= threshold, ratio e^0.1 > 1 with A < 0: pulls back toward the rollout, kept.
#           A = -7 is beyond adv_clip_max = 5 and stays -7: this loss does not clamp advantages.
# Sample 2: KL (1e-6 / 0.08 + 0) / 2 = 6.25e-6 < threshold: kept although ratio < 1 with A < 0 widens.
DRIFT = [[0.01, 0.01], [0.01, 0.01], [0.001, 0.0]]
LOG_RATIOS = [0.2, 0.1, -0.3]
ADVANTAGES = [1.0, -7.0, -1.0]


def _cfg(**fields):
    base = {"kl_mask_threshold": THRESHOLD, "add_kl_coefficient": True, "adv_clip_max": 5.0, "kl_beta": 0.0}
    base.update(fields)
    return SimpleNamespace(**base)


def _input(advantages=ADVANTAGES, log_ratios=LOG_RATIOS, weights=None, ref_mean=None):
    old = torch.tensor([-1.0, -2.0, -3.0])
    return PolicyLossInput(
        log_prob=(old + torch.tensor(log_ratios)).requires_grad_(True),
        old_log_prob=old,
        advantages=torch.tensor(advantages),
        mean=torch.tensor(DRIFT).requires_grad_(True),
        old_mean=torch.zeros(3, 2),
        ref_mean=ref_mean,
        std=torch.tensor(STD),
        sqrt_dt=torch.tensor(SQRT_DT),
        weights=weights,
    )


def _hand_kl(add_kl_coefficient=True):
    kl = []
    for row, std, sqrt_dt in zip(DRIFT, STD, SQRT_DT):
        denom = 2 * (std * sqrt_dt) ** 2 if add_kl_coefficient else 2.0
        kl.append(sum(d * d / denom for d in row) / len(row))
    return kl


def test_masked_sample_contributes_zero_and_stays_in_the_denominator():
    out = LOSSES.get("flow_dppo")(_input(), _cfg())
    assert _hand_kl() == pytest.approx([0.005, 0.005, 6.25e-6])
    expected = (0.0 + 7.0 * math.exp(0.1) + math.exp(-0.3)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.metrics["policy_loss"].item() == pytest.approx(expected, rel=1e-6)
    assert out.metrics["dppo/masked_fraction"].item() == pytest.approx(1 / 3)


def test_gradient_is_zero_on_masked_rows_and_never_flows_through_the_mask_kl():
    inp = _input()
    LOSSES.get("flow_dppo")(inp, _cfg()).loss.backward()
    grad = inp.log_prob.grad.tolist()
    assert grad[0] == 0.0
    assert grad[1] == pytest.approx(7.0 * math.exp(0.1) / 3, rel=1e-6)
    assert grad[2] == pytest.approx(math.exp(-0.3) / 3, rel=1e-6)
    assert inp.mean.grad is None or inp.mean.grad.abs().sum().item() == 0.0


def test_without_kl_coefficient_the_kl_is_half_the_squared_drift():
    # mean(d^2) / 2: 5e-5, 5e-5, 2.5e-7, all below 1e-4: nothing is masked
    out = LOSSES.get("flow_dppo")(_input(), _cfg(add_kl_coefficient=False, kl_mask_threshold=1e-4))
    assert _hand_kl(add_kl_coefficient=False) == pytest.approx([5e-5, 5e-5, 2.5e-7])
    expected = sum(-a * math.exp(lr) for a, lr in zip(ADVANTAGES, LOG_RATIOS)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.metrics["dppo/masked_fraction"].item() == 0.0
    assert out.metrics["dppo/kl_mean"].item() == pytest.approx(sum(_hand_kl(False)) / 3)


def test_the_settings_defaults_are_flow_dppos():
    # threshold 1e-5: samples 0 and 1 (KL 0.005) are above it, sample 2 (6.25e-6) below; only sample 0 widens
    defaults = FlowDppoSettings()
    assert (defaults.kl_mask_threshold, defaults.add_kl_coefficient, defaults.kl_beta) == (1e-5, True, 0.0)
    out = LOSSES.get("flow_dppo")(_input(), defaults)
    assert out.metrics["dppo/masked_fraction"].item() == pytest.approx(1 / 3)
    assert out.metrics["dppo/kl_mean"].item() == pytest.approx(sum(_hand_kl()) / 3)


def test_ratio_exactly_one_is_never_masked():
    out = LOSSES.get("flow_dppo")(_input(log_ratios=[0.0, 0.0, 0.0], advantages=[1.0, -1.0, 1.0]), _cfg())
    assert out.metrics["dppo/masked_fraction"].item() == 0.0
    assert out.loss.item() == pytest.approx((-1.0 + 1.0 - 1.0) / 3)


def test_negative_advantage_with_ratio_below_one_is_masked_at_high_kl():
    # sample 1 now has ratio e^-0.1 < 1 with A < 0 and KL 0.005: widening, masked too
    out = LOSSES.get("flow_dppo")(_input(log_ratios=[0.2, -0.1, -0.3]), _cfg())
    assert out.metrics["dppo/masked_fraction"].item() == pytest.approx(2 / 3)
    assert out.loss.item() == pytest.approx(math.exp(-0.3) / 3, rel=1e-6)


def test_weights_and_metrics():
    weights = [3.0, 0.5, 2.0]
    out = LOSSES.get("flow_dppo")(_input(weights=torch.tensor(weights)), _cfg())
    terms = [0.0, 7.0 * math.exp(0.1), math.exp(-0.3)]
    assert out.loss.item() == pytest.approx(sum(w * t for w, t in zip(weights, terms)) / 3, rel=1e-6)
    ratios = [math.exp(x) for x in LOG_RATIOS]
    mean_ratio = sum(ratios) / 3
    assert out.metrics["ratio_mean"].item() == pytest.approx(mean_ratio)
    assert out.metrics["ratio_std"].item() == pytest.approx(math.sqrt(sum((r - mean_ratio) ** 2 for r in ratios) / 3))
    assert out.metrics["approx_kl"].item() == pytest.approx(0.5 * sum(x * x for x in LOG_RATIOS) / 3)
    assert out.metrics["dppo/kl_mean"].item() == pytest.approx(sum(_hand_kl()) / 3)
    assert all(not v.requires_grad and v.ndim == 0 for v in out.metrics.values())


def test_optional_kl_to_reference_is_added_unmasked():
    beta = 0.5
    ref = torch.zeros(3, 2)
    out = LOSSES.get("flow_dppo")(_input(ref_mean=ref), _cfg(kl_beta=beta))
    kl_ref = [sum(d * d for d in row) / 2 / (2 * std**2) for row, std in zip(DRIFT, STD)]
    terms = [0.0, 7.0 * math.exp(0.1), math.exp(-0.3)]
    assert out.loss.item() == pytest.approx(sum(t + beta * k for t, k in zip(terms, kl_ref)) / 3, rel=1e-6)
    with pytest.raises(ValueError, match="ref_mean"):
        LOSSES.get("flow_dppo")(_input(), _cfg(kl_beta=beta))
