"""The ratio metrics every policy-gradient loss logs (ppo_kl, clip fractions by side, ratio min/max) and Flow-DPPO's
mask fractions, against plain Python loops over the same numbers."""

import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.policy_gradient import PolicyLossInput
from diffusion_rl.config.plugins import LOSSES

# five samples; clip range 0.1: ratio e^0.2 = 1.22 and e^0.15 = 1.16 clip above, e^-0.3 = 0.74 below
LOG_RATIOS = [0.2, -0.05, -0.3, 0.15, 0.0]
ADVANTAGES = [1.0, -2.0, -1.0, 0.5, 3.0]
CLIP = 0.1


def _input(log_ratios=LOG_RATIOS, advantages=ADVANTAGES, drift=None, std=None, sqrt_dt=None):
    n = len(log_ratios)
    old = torch.linspace(-1.0, -3.0, n)
    drift = torch.zeros(n, 2) if drift is None else torch.tensor(drift)
    return PolicyLossInput(
        log_prob=old + torch.tensor(log_ratios),
        old_log_prob=old,
        advantages=torch.tensor(advantages),
        mean=drift,
        old_mean=torch.zeros(n, 2),
        ref_mean=None,
        std=torch.ones(n) if std is None else torch.tensor(std),
        sqrt_dt=torch.full((n,), 0.1) if sqrt_dt is None else torch.tensor(sqrt_dt),
    )


def _hand_ratio_metrics(log_ratios, ratios, clip):
    n = len(ratios)
    mean = sum(ratios) / n
    out = {
        "ppo_kl": sum(-x for x in log_ratios) / n,
        "approx_kl": sum(0.5 * x * x for x in log_ratios) / n,
        "ratio_mean": mean,
        "ratio_std": math.sqrt(sum((r - mean) ** 2 for r in ratios) / n),  # ddof 0
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }
    if clip is not None:
        out["clip_fraction"] = sum(abs(r - 1) > clip for r in ratios) / n
        out["clip_fraction_higher"] = sum(r - 1 > clip for r in ratios) / n
        out["clip_fraction_lower"] = sum(1 - r > clip for r in ratios) / n
    return out


def _check(metrics, expected):
    for name, value in expected.items():
        assert metrics[name].item() == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_flow_grpo_logs_ppo_kl_and_clip_fractions_by_side():
    cfg = SimpleNamespace(clip_range=CLIP, adv_clip_max=5.0, kl_beta=0.0)
    out = LOSSES.get("flow_grpo")(_input(), cfg)
    expected = _hand_ratio_metrics(LOG_RATIOS, [math.exp(x) for x in LOG_RATIOS], CLIP)
    assert (expected["clip_fraction_higher"], expected["clip_fraction_lower"]) == (2 / 5, 1 / 5)
    assert expected["ppo_kl"] == pytest.approx(0.0)  # the log-ratios sum to 0
    _check(out.metrics, expected)


def test_grpo_guard_clip_fractions_are_of_its_rescaled_ratio_and_ppo_kl_of_the_plain_one():
    clip = 2e-3
    cfg = SimpleNamespace(clip_range=clip, adv_clip_max=5.0, kl_beta=0.0)
    drift = [[0.01, 0.0], [0.0, 0.0], [0.02, 0.02], [0.0, 0.01], [0.0, 0.0]]
    out = LOSSES.get("grpo_guard")(_input(drift=drift), cfg)
    s = 0.1 * 1.0  # mean(√dt) · mean(std)
    ratios = []
    for lr, row in zip(LOG_RATIOS, drift):
        bias = sum(d * d for d in row) / len(row) / (2 * s * s)
        ratios.append(math.exp((lr + bias) * s))
    expected = _hand_ratio_metrics(LOG_RATIOS, ratios, clip)
    assert expected["clip_fraction_higher"] > 0 and expected["clip_fraction_lower"] > 0
    _check(out.metrics, expected)


def test_flow_dppo_splits_its_mask_by_side_and_logs_ratio_extremes():
    # noise std 0.1 for all; kl_i = mean(d²) / 0.02; threshold 1e-3
    drift = [[0.01, 0.01], [0.01, 0.01], [0.01, 0.0], [0.001, 0.0], [0.01, 0.01]]
    cfg = SimpleNamespace(kl_mask_threshold=1e-3, add_kl_coefficient=True, adv_clip_max=5.0, kl_beta=0.0)
    out = LOSSES.get("flow_dppo")(_input(drift=drift), cfg)
    ratios = [math.exp(x) for x in LOG_RATIOS]
    kl = [sum(d * d for d in row) / 2 / (2 * 0.1**2) for row in drift]
    far = [k >= 1e-3 for k in kl]
    pos = [f and r > 1 and a > 0 for f, r, a in zip(far, ratios, ADVANTAGES)]
    neg = [f and r < 1 and a < 0 for f, r, a in zip(far, ratios, ADVANTAGES)]
    # sample 0 widens up (A > 0, ratio > 1), samples 1 and 2 widen down; sample 3 is near; sample 4 has ratio 1
    assert far == [True, True, True, False, True] and pos == [True, False, False, False, False]
    assert neg == [False, True, True, False, False]
    expected = _hand_ratio_metrics(LOG_RATIOS, ratios, None)
    expected.update({
        "dppo/masked_fraction": 3 / 5,
        "dppo/pos_masked_fraction": 1 / 5,
        "dppo/neg_masked_fraction": 2 / 5,
        "dppo/far_fraction": 4 / 5,
        "dppo/kl_mean": sum(kl) / 5,
        "dppo/kl_max": max(kl),
    })  # fmt: skip
    _check(out.metrics, expected)
    assert "clip_fraction" not in out.metrics


def test_the_update_loop_reports_the_extremes_over_passes_not_their_mean():
    from diffusion_rl.metrics import reduce_metrics

    passes = [{"ratio_min": lo, "ratio_max": hi, "ratio_mean": hi} for lo, hi in ([1.0, 3.0], [0.5, 5.0], [2.0, 4.0])]
    out = reduce_metrics(passes)
    assert (out["ratio_min"], out["ratio_max"], out["ratio_mean"]) == (0.5, 5.0, 4.0)
