"""GARDO: the gated-KL loss and its gradient, the diversity weights, the rank disagreement, the gated share and the
gate, against numbers written out in plain Python loops."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diffusion_rl.algorithms.base import LOSSES
from diffusion_rl.algorithms.losses.gardo import (
    GardoSettings,
    GateShare,
    disagreement,
    diversity_weights,
    gate,
    gate_weights,
)
from diffusion_rl.algorithms.policy_gradient import PolicyLossInput

CLIP, BETA = 1e-3, 0.5
LOG_RATIOS = [0.0005, 0.01, -0.02, 0.0]  # inside the clip; above it with A > 0; below it with A < 0; on-policy
ADVANTAGES = [1.5, 2.0, -6.0, 0.5]  # the third is clamped to −5
KL_WEIGHTS = [2.0, 0.0, 2.0, 0.0]  # rows 0 and 2 gated (1 / share of 0.5)
MEANS = [[0.1, -0.2], [0.3, 0.0], [-0.5, 0.4], [0.2, 0.2]]
REF_MEANS = [[0.0, 0.0], [0.1, 0.1], [-0.1, 0.1], [0.0, 0.5]]
STDS = [0.5, 1.0, 2.0, 0.25]


def test_loss_is_flow_grpo_s_clipped_term_plus_the_kl_of_the_gated_rows_and_its_gradient():
    old = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    inp = PolicyLossInput(
        log_prob=(old + torch.tensor(LOG_RATIOS)).requires_grad_(True), old_log_prob=old,
        advantages=torch.tensor(ADVANTAGES), mean=torch.tensor(MEANS, requires_grad=True),
        old_mean=torch.zeros(4, 2), ref_mean=torch.tensor(REF_MEANS), std=torch.tensor(STDS),
        sqrt_dt=torch.ones(4), kl_weights=torch.tensor(KL_WEIGHTS),
    )  # fmt: skip
    out = LOSSES.get("gardo")(inp, SimpleNamespace(clip_range=CLIP, adv_clip_max=5.0, kl_beta=BETA))
    terms, kls = [], []
    for i in range(4):
        a, r = min(max(ADVANTAGES[i], -5.0), 5.0), math.exp(LOG_RATIOS[i])
        kl = sum((m - q) ** 2 for m, q in zip(MEANS[i], REF_MEANS[i])) / 2 / (2 * STDS[i] ** 2)
        kls.append(kl)
        terms.append(max(-a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP)) + BETA * KL_WEIGHTS[i] * kl)
    assert out.loss.item() == pytest.approx(sum(terms) / 4, rel=1e-6)
    # the KL term is kl_beta times the mean kl over the gated rows: (kl_0 + kl_2) / 2
    assert out.metrics["gardo/kl_gated"].item() == pytest.approx((kls[0] + kls[2]) / 2, rel=1e-6)
    out.loss.backward()
    expected = [-a * math.exp(lr) / 4 if abs(math.exp(lr) - 1) <= CLIP else 0.0
                for lr, a in zip(LOG_RATIOS, ADVANTAGES)]  # fmt: skip
    assert inp.log_prob.grad.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-9)
    # d/d mean_i,e of β·w_i·Σ_e (m − q)² / 2 / (2 s²) / 4 = β·w_i·(m − q) / (2 s²) / 4; 0 for the ungated rows
    grad_mean = [[BETA * KL_WEIGHTS[i] * (m - q) / (2 * STDS[i] ** 2) / 4 for m, q in zip(MEANS[i], REF_MEANS[i])]
                 for i in range(4)]  # fmt: skip
    assert inp.mean.grad.flatten().tolist() == pytest.approx(sum(grad_mean, []), rel=1e-5, abs=1e-9)


def test_without_kl_weights_every_row_s_kl_counts():
    inp = PolicyLossInput(
        log_prob=torch.zeros(2), old_log_prob=torch.zeros(2), advantages=torch.zeros(2),
        mean=torch.tensor([[1.0], [0.0]]), old_mean=torch.zeros(2, 1), ref_mean=torch.zeros(2, 1),
        std=torch.ones(2), sqrt_dt=torch.ones(2),
    )  # fmt: skip
    out = LOSSES.get("gardo")(inp, SimpleNamespace(clip_range=CLIP, adv_clip_max=5.0, kl_beta=1.0))
    assert out.loss.item() == pytest.approx((0.5 + 0.0) / 2)


def test_positive_advantages_are_scaled_by_the_distance_to_the_nearest_image_over_the_group_s_mean():
    nearest = np.array([0.1, 0.3, 0.2, 0.2, 0.0, 0.0, np.nan])
    groups = np.array([0, 0, 0, 0, 1, 1, 2])
    adv = np.array([1.0, 0.5, -1.0, 0.0, 1.0, -1.0, 0.0])
    got = diversity_weights(nearest, groups, adv)
    mean0 = (0.1 + 0.3 + 0.2 + 0.2) / 4  # 0.2
    # group 0: rows 0, 1 have A > 0 → d / mean; row 2 (A < 0) and row 3 (A = 0) keep 1; group 1: identical
    # images (mean 0) keep 1; row 6 is alone (NaN) and keeps 1
    assert got.tolist() == pytest.approx([0.1 / mean0, 0.3 / mean0, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_disagreement_is_the_judges_mean_rank_minus_the_reward_s_rank():
    total = np.array([0.9, 0.5, 0.1, np.nan, 0.7])
    judge_a = np.array([0.1, 0.5, 0.9, 0.3, 0.6])  # higher is better
    judge_b = np.array([0.2, 0.8, 0.4, 0.0, 0.1])
    u = disagreement(total, [judge_a, judge_b])
    valid = [0, 1, 2, 4]

    def ranks(values):
        order = sorted(valid, key=lambda i: -values[i])  # 1 = best
        return {i: order.index(i) + 1 for i in valid}

    r, a, b = ranks(total), ranks(judge_a), ranks(judge_b)
    expected = [(a[i] + b[i]) / 2 - r[i] if i in valid else math.nan for i in range(5)]
    assert u.tolist() == pytest.approx(expected, nan_ok=True)
    # by hand: row 0 is the reward's best (rank 1), judge a's worst (4) and judge b's third (3): u = 3.5 − 1
    assert u[0] == 2.5 and np.isnan(u[3])


def test_the_gate_takes_the_rows_above_the_quantile_of_the_non_negative_u():
    u = np.array([3.0, -1.0, 0.0, 1.0, 2.0, np.nan])
    # non-negative u: 0, 1, 2, 3; the 75th percentile, linear: 2.25 → only row 0
    assert gate(u, 0.25).tolist() == [True, False, False, False, False, False]
    # the 50th: 1.5 → rows 0 and 4
    assert gate(u, 0.5).tolist() == [True, False, False, False, True, False]
    assert not gate(np.array([-1.0, np.nan]), 0.5).any()


def test_the_gated_share_grows_on_a_new_high_and_shrinks_on_a_new_low_within_its_bounds():
    s = GardoSettings(gate_share=0.1, gate_min=0.02, gate_max=0.2, gate_rate=0.1, gate_window=2)
    share = GateShare(0.1, [])
    seen = []
    for mean in [1.0, 2.0, 1.5, 0.5, 0.4, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]:
        seen.append(share.update(np.array([mean, -1.0]), s))  # the negative row is left out of the mean
    expected, value, history = [], 0.1, []
    for mean in [1.0, 2.0, 1.5, 0.5, 0.4, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]:
        if not history:
            value = 0.1
        elif mean > max(history):
            value *= 1.1
        elif mean < min(history):
            value *= 0.9
        value = min(max(value, 0.02), 0.2)
        history = (history + [mean])[-2:]
        expected.append(value)
    assert seen == pytest.approx(expected)
    assert seen[:5] == pytest.approx([0.1, 0.11, 0.11, 0.099, 0.0891])  # by hand: ×1.1, as is, ×0.9, ×0.9
    assert GateShare(0.19, [0.0]).update(np.array([1.0]), s) == 0.2  # 0.209, capped at gate_max
    # a step with no row at u ≥ 0 leaves it and its history as they are
    before = (share.share, list(share.history))
    assert share.update(np.array([-1.0, np.nan]), s) == before[0] and share.history == before[1]


def test_gate_weights_average_one_over_the_kept_rows():
    gated = np.array([True, True, False, False, True])
    kept = np.array([True, False, True, True, True])  # row 1 is gated but dropped (its advantage is 0)
    weights, share = gate_weights(gated, kept)
    assert share == pytest.approx(2 / 4)
    assert weights.tolist() == pytest.approx([2.0, 2.0, 0.0, 0.0, 2.0])
    kl = [0.3, 9.0, 0.5, 0.7, 0.1]
    kept_rows = [i for i in range(5) if kept[i]]
    # the loss's mean over its kept rows of g_i/mean(g)·kl_i: the mean of kl over the kept gated rows (0 and 4)
    assert sum(weights[i] * kl[i] for i in kept_rows) / len(kept_rows) == pytest.approx((0.3 + 0.1) / 2)
    weights, share = gate_weights(gated, np.ones(5, dtype=bool))
    assert share == pytest.approx(3 / 5) and weights.tolist() == pytest.approx([5 / 3, 5 / 3, 0, 0, 5 / 3])
    weights, share = gate_weights(gated, np.array([False, True, True, True, False]))  # only a gated row kept: 1 of 3
    assert share == pytest.approx(1 / 3) and weights.tolist() == pytest.approx([3.0, 3.0, 0, 0, 3.0])
    weights, share = gate_weights(np.zeros(3, dtype=bool), np.ones(3, dtype=bool))
    assert share == 0.0 and weights.tolist() == [0.0, 0.0, 0.0]
