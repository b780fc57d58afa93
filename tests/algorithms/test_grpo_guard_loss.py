import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.policy_gradient import PolicyLossInput
from diffusion_rl.config.plugins import LOSSES

CLIP = 0.05
SQRT_DT = [0.5, 0.5, 0.5]
STD = [0.8, 1.0, 1.2]  # mean 1.0, so s = 0.5 * 1.0; a per-sample std would give other numbers
SCALE = 0.5
# Step-mean drift from the rollout's mean, per sample (old_mean = 0).
# Sample 0: mean sq 0.01 -> bias 0.01 / (2 * 0.25) = 0.02; (0.04 + 0.02) * 0.5 = 0.03 -> ratio e^0.03, inside.
# Sample 1: mean sq 0.05 -> bias 0.1; (0.3 + 0.1) * 0.5 = 0.2 -> ratio e^0.2 > 1.05 with A > 0: clipped.
# Sample 2: no drift -> bias 0; -0.4 * 0.5 = -0.2 -> ratio e^-0.2 < 0.95 with A < 0: clipped.
# The batch-mean bias (0.04) differs from sample 0's own, so averaging it over the batch would show.
DRIFT = [[0.1, 0.1], [0.3, 0.1], [0.0, 0.0]]
LOG_RATIOS = [0.04, 0.3, -0.4]
ADVANTAGES = [1.0, 2.0, -1.5]


def _cfg(clip_range=CLIP, adv_clip_max=5.0, kl_beta=0.0):
    return SimpleNamespace(clip_range=clip_range, adv_clip_max=adv_clip_max, kl_beta=kl_beta)


def _input(advantages=ADVANTAGES, ref_mean=None, weights=None):
    old = torch.tensor([-1.0, -2.0, -3.0])
    log_prob = (old + torch.tensor(LOG_RATIOS)).requires_grad_(True)
    return PolicyLossInput(
        log_prob=log_prob,
        old_log_prob=old,
        advantages=torch.tensor(advantages),
        mean=torch.tensor(DRIFT).requires_grad_(True),
        old_mean=torch.zeros(3, 2),
        ref_mean=ref_mean,
        std=torch.tensor(STD),
        sqrt_dt=torch.tensor(SQRT_DT),
        weights=weights,
    )


def _hand_bias():
    s = (sum(SQRT_DT) / 3) * (sum(STD) / 3)
    return [sum(d * d for d in row) / len(row) / (2 * s * s) for row in DRIFT]


def _hand_ratios():
    return [math.exp((lr + b) * SCALE) for lr, b in zip(LOG_RATIOS, _hand_bias())]


def _hand_policy_terms(advantages, clip=CLIP):
    dt = (sum(SQRT_DT) / 3) ** 2
    terms = []
    for a, ratio in zip(advantages, _hand_ratios()):
        clipped_ratio = min(max(ratio, 1 - clip), 1 + clip)
        terms.append(max(-a * ratio, -a * clipped_ratio) / dt)
    return terms


def test_policy_loss_matches_hand_computation():
    out = LOSSES.get("grpo_guard")(_input(), _cfg())
    assert _hand_bias() == pytest.approx([0.02, 0.1, 0.0])
    # By hand: (-1 * e^0.03) / 0.25, (-2 * 1.05) / 0.25, (1.5 * 0.95) / 0.25
    expected_terms = [-math.exp(0.03) / 0.25, -2.1 / 0.25, 1.425 / 0.25]
    assert _hand_policy_terms(ADVANTAGES) == pytest.approx(expected_terms)
    assert out.loss.item() == pytest.approx(sum(expected_terms) / 3, rel=1e-6)
    assert out.metrics["policy_loss"].item() == pytest.approx(sum(expected_terms) / 3, rel=1e-6)


def test_gradient_is_zero_for_clipped_samples_and_flows_through_the_bias_otherwise():
    inp = _input()
    LOSSES.get("grpo_guard")(inp, _cfg()).loss.backward()
    ratio0 = math.exp(0.03)
    # loss_0 = -A ratio / (B dt); d ratio / d log_prob = ratio * s
    assert inp.log_prob.grad[0].item() == pytest.approx(-ratio0 * SCALE / (3 * 0.25), rel=1e-5)
    # d bias / d mean_k = 2 m_k / (N * 2 s^2) with N = 2 elements: 0.1 / (2 * 0.25) = 0.2
    for k in range(2):
        assert inp.mean.grad[0, k].item() == pytest.approx(-ratio0 * SCALE * 0.2 / (3 * 0.25), rel=1e-5)
    assert inp.log_prob.grad[1:].abs().sum().item() == 0.0
    assert inp.mean.grad[1:].abs().sum().item() == 0.0


def test_metrics_match_hand_computation():
    out = LOSSES.get("grpo_guard")(_input(), _cfg())
    ratios = _hand_ratios()
    mean_ratio = sum(ratios) / 3
    assert out.metrics["guard/scale"].item() == pytest.approx(SCALE)
    assert out.metrics["guard/bias_mean"].item() == pytest.approx(sum(_hand_bias()) / 3)
    assert out.metrics["clip_fraction"].item() == pytest.approx(2 / 3)
    assert out.metrics["approx_kl"].item() == pytest.approx(0.5 * sum(x * x for x in LOG_RATIOS) / 3)
    assert out.metrics["ratio_mean"].item() == pytest.approx(mean_ratio)
    assert out.metrics["ratio_std"].item() == pytest.approx(math.sqrt(sum((r - mean_ratio) ** 2 for r in ratios) / 3))
    assert out.metrics["kl_ref"].item() == 0.0
    assert all(not v.requires_grad and v.ndim == 0 for v in out.metrics.values())


def test_advantages_are_clamped():
    out = LOSSES.get("grpo_guard")(_input(advantages=[10.0, 2.0, -7.0]), _cfg(adv_clip_max=1.5))
    expected = _hand_policy_terms([1.5, 1.5, -1.5])
    assert out.loss.item() == pytest.approx(sum(expected) / 3, rel=1e-6)


def test_kl_to_reference_and_weights():
    ref = torch.tensor([[0.0, 0.1], [-0.1, 0.1], [0.2, 0.0]])
    weights = [1.0, 0.5, 2.0]
    beta = 0.1
    inp = _input(ref_mean=ref, weights=torch.tensor(weights))
    out = LOSSES.get("grpo_guard")(inp, _cfg(kl_beta=beta))

    kl = []
    for i in range(3):
        sq = [(DRIFT[i][k] - ref[i, k].item()) ** 2 for k in range(2)]
        kl.append(sum(sq) / 2 / (2 * STD[i] ** 2))
    # (0.01 + 0)/2 / 1.28;  (0.16 + 0)/2 / 2;  (0.04 + 0)/2 / 2.88
    assert kl == pytest.approx([0.01 / 2 / 1.28, 0.08 / 2, 0.02 / 2.88])
    policy = _hand_policy_terms(ADVANTAGES)
    expected = sum(w * (p + beta * k) for w, p, k in zip(weights, policy, kl)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.metrics["kl_ref"].item() == pytest.approx(sum(kl) / 3)


def test_kl_without_reference_mean_is_an_error():
    with pytest.raises(ValueError, match="ref_mean"):
        LOSSES.get("grpo_guard")(_input(), _cfg(kl_beta=0.04))


def test_no_drift_and_no_log_ratio_gives_ratio_one():
    inp = PolicyLossInput(
        log_prob=torch.tensor([-1.0, -2.0]),
        old_log_prob=torch.tensor([-1.0, -2.0]),
        advantages=torch.tensor([1.0, -1.0]),
        mean=torch.ones(2, 3),
        old_mean=torch.ones(2, 3),
        ref_mean=None,
        std=torch.tensor([0.7, 0.7]),
        sqrt_dt=torch.tensor([0.3, 0.3]),
    )
    out = LOSSES.get("grpo_guard")(inp, _cfg(clip_range=2e-6))
    assert out.metrics["ratio_mean"].item() == 1.0
    # -1 / 0.09 + 1 / 0.09 over two samples
    assert out.loss.item() == pytest.approx(0.0, abs=1e-6)
