import math

import pytest
import torch

from diffusion_rl.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    correction_weights,
    rejection_masks,
)

# log w = logp_old - logp_rollout for 3 samples x 2 steps
LOG_W = [[0.1, -0.2], [1.0, 0.5], [-1.0, 0.3]]
ROLLOUT = [[-1.0, -2.0], [-3.0, -1.5], [-0.5, -2.5]]


def _logps(log_w=LOG_W):
    rollout = torch.tensor(ROLLOUT)
    return rollout + torch.tensor(log_w), rollout


def _run(log_w=LOG_W, **cfg):
    old, rollout = _logps(log_w)
    return correction_weights(old, rollout, RolloutCorrectionConfig(**cfg))


def _weights(log_w=LOG_W, **cfg):
    return _run(log_w, **cfg).weights_BW.tolist()


def _flat(rows):
    return [x for row in rows for x in row]


def _keep(stat, level, bound, log_w=LOG_W):
    """Hand rejection: keep per step (level 'step') or one decision per row broadcast over the steps."""
    rows = []
    for row in log_w:
        if stat == "k1":
            values = [-x for x in row]
        elif stat == "k2":
            values = [0.5 * x * x for x in row]
        else:
            values = [math.exp(x) - 1 - x for x in row]

        def ok(v):
            if stat == "k1":
                return math.log(bound[0]) <= v <= math.log(bound[1])
            return v <= bound

        if level == "step":
            rows.append([1.0 if ok(v) else 0.0 for v in values])
        else:
            agg = {"sum": sum(values), "mean": sum(values) / len(values), "max": max(values)}[level]
            rows.append([1.0 if ok(agg) else 0.0] * len(values))
    return rows


def test_tis_at_step_level_truncates_each_step():
    expected = [[math.exp(0.1), math.exp(-0.2)], [2.0, math.exp(0.5)], [math.exp(-1.0), math.exp(0.3)]]
    assert _flat(_weights(mode="decoupled")) == pytest.approx(_flat(expected), rel=1e-6)


def test_tis_at_sequence_level_uses_the_window_sum_on_every_step():
    # row sums -0.1, 1.5 (e^1.5 = 4.48 truncated to 2), -0.7
    expected = [[math.exp(-0.1)] * 2, [2.0] * 2, [math.exp(-0.7)] * 2]
    assert _flat(_weights(mode="decoupled", level="sequence")) == pytest.approx(_flat(expected), rel=1e-6)


def test_icepop_zeroes_weights_outside_the_band():
    # e^1.0 = 2.72 > 2 and e^-1.0 = 0.37 < 0.5 are dropped; the rest are kept untruncated
    expected = [[math.exp(0.1), math.exp(-0.2)], [0.0, math.exp(0.5)], [0.0, math.exp(0.3)]]
    out = _run(mode="decoupled", is_kind="icepop", icepop_lo=0.5, icepop_hi=2.0)
    assert _flat(out.weights_BW.tolist()) == pytest.approx(_flat(expected), rel=1e-6)
    assert out.metrics["rollout_corr/is_changed_fraction"].item() == pytest.approx(2 / 6)


def test_icepop_at_sequence_level():
    # row sums -0.1 (0.905 kept), 1.5 (4.48 dropped), -0.7 (0.497 < 0.5 dropped)
    expected = [[math.exp(-0.1)] * 2, [0.0, 0.0], [0.0, 0.0]]
    weights = _weights(mode="decoupled", level="sequence", is_kind="icepop")
    assert _flat(weights) == pytest.approx(_flat(expected), rel=1e-6)


def test_is_none_gives_unit_weights():
    assert _weights(mode="decoupled", is_kind="none") == [[1.0, 1.0]] * 3


def test_log_weights_are_clamped_at_twenty():
    big = [[30.0, -1.0], [-25.0, 0.0], [15.0, 10.0]]
    step = _weights(big, mode="decoupled", threshold=1e12)
    assert step[0][0] == pytest.approx(math.exp(20.0), rel=1e-5)
    assert step[1][0] == pytest.approx(math.exp(-20.0), rel=1e-5)
    # the window sum 25 is clamped after summing, not each step before
    seq = _weights(big, mode="decoupled", level="sequence", threshold=1e12)
    assert seq[2] == pytest.approx([math.exp(20.0)] * 2, rel=1e-5)
    assert seq[0] == pytest.approx([math.exp(20.0)] * 2, rel=1e-5)
    assert seq[1] == pytest.approx([math.exp(-20.0)] * 2, rel=1e-5)


@pytest.mark.parametrize(
    "stat, bound, hand_bound",
    [("k1", 1.5, (1 / 1.5, 1.5)), ("k1", (0.5, 3.0), (0.5, 3.0)), ("k2", 0.1, 0.1), ("k3", 0.1, 0.1)],
)
def test_rejection_at_step_level(stat, bound, hand_bound):
    mask = _keep(stat, "step", hand_bound)
    assert _weights(rs_stat=stat, rs_bound=bound) == mask  # bypass: the mask alone
    # decoupled: IS weight times the mask
    is_w = [[min(math.exp(x), 2.0) for x in row] for row in LOG_W]
    expected = [[w * m for w, m in zip(wr, mr)] for wr, mr in zip(is_w, mask)]
    weights = _weights(mode="decoupled", rs_stat=stat, rs_bound=bound)
    assert _flat(weights) == pytest.approx(_flat(expected), rel=1e-6)


def test_step_level_masks_are_the_ones_worked_out_by_hand():
    # |log w| ≤ log 1.5 = 0.405 keeps 0.1, -0.2, 0.3 only
    assert _keep("k1", "step", (1 / 1.5, 1.5)) == [[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]
    # log w in [-log 3, log 2] = [-1.10, 0.69]: only 1.0 is out
    assert _keep("k1", "step", (0.5, 3.0)) == [[1.0, 1.0], [0.0, 1.0], [1.0, 1.0]]


@pytest.mark.parametrize(
    "level, stat, bound",
    [
        ("sum", "k1", (0.5, 2.0)),
        ("mean", "k1", (0.5, 2.0)),
        ("sum", "k2", 0.2),
        ("mean", "k2", 0.2),
        ("max", "k2", 0.2),
        ("sum", "k3", 0.2),
        ("mean", "k3", 0.2),
        ("max", "k3", 0.2),
    ],
)  # k1 with max is refused by the config (test_invalid_config_is_rejected)
def test_rejection_at_sequence_level_rejects_whole_samples(level, stat, bound):
    expected = _keep(stat, level, bound)
    out = _run(rs_stat=stat, rs_bound=bound, rs_level=level)
    assert out.weights_BW.tolist() == expected
    assert all(row[0] == row[1] for row in expected)
    assert out.metrics["rollout_corr/rejected_fraction"].item() == pytest.approx(
        sum(1.0 - m for row in expected for m in row) / 6
    )


def test_sequence_level_masks_are_the_ones_worked_out_by_hand():
    # k1 row sums 0.1, -1.5, 0.7 against [log 0.5, log 2] = ±0.693
    assert _keep("k1", "sum", (0.5, 2.0)) == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    # k1 row means 0.05, -0.75, 0.35
    assert _keep("k1", "mean", (0.5, 2.0)) == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    # k2 per step: row 0 0.005, 0.02; row 1 0.5, 0.125; row 2 0.5, 0.045
    assert _keep("k2", "sum", 0.2) == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    assert _keep("k2", "max", 0.6) == [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    assert _keep("k2", "mean", 0.3) == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]


def test_bypass_without_rejection_gives_ones_and_is_inactive():
    cfg = RolloutCorrectionConfig()
    assert not cfg.active
    assert RolloutCorrectionConfig(rs_stat="k2", rs_bound=1.0).active
    assert RolloutCorrectionConfig(mode="decoupled").active
    out = _run()
    assert out.weights_BW.tolist() == [[1.0, 1.0]] * 3
    assert out.metrics["rollout_corr/is_weight_mean"].item() == 1.0
    assert out.metrics["rollout_corr/rejected_fraction"].item() == 0.0


def test_metrics_match_hand_computation():
    out = _run(mode="decoupled", rs_stat="k2", rs_bound=0.1)
    flat = [x for row in LOG_W for x in row]
    is_w = [min(math.exp(x), 2.0) for x in flat]
    mean_w = sum(is_w) / 6
    keep = [m for row in _keep("k2", "step", 0.1) for m in row]
    m = out.metrics
    assert m["rollout_corr/abs_dlogp_mean"].item() == pytest.approx(sum(abs(x) for x in flat) / 6)
    assert m["rollout_corr/abs_dlogp_max"].item() == pytest.approx(1.0)
    assert m["rollout_corr/is_weight_mean"].item() == pytest.approx(mean_w)
    assert m["rollout_corr/is_weight_std"].item() == pytest.approx(math.sqrt(sum((w - mean_w) ** 2 for w in is_w) / 6))
    assert m["rollout_corr/is_changed_fraction"].item() == pytest.approx(1 / 6)
    assert m["rollout_corr/rejected_fraction"].item() == pytest.approx(1 - sum(keep) / 6)
    assert m["rollout_corr/weight_mean"].item() == pytest.approx(sum(w * k for w, k in zip(is_w, keep)) / 6)
    assert all(not v.requires_grad and v.ndim == 0 for v in m.values())


def test_weights_are_detached():
    old, rollout = _logps()
    old.requires_grad_(True)
    out = correction_weights(old * 1.0, rollout, RolloutCorrectionConfig(mode="decoupled", rs_stat="k3", rs_bound=0.5))
    assert not out.weights_BW.requires_grad


def test_rejection_masks_alone():
    log_w = torch.tensor(LOG_W)
    [(name, keep)] = rejection_masks(log_w, RolloutCorrectionConfig(rs_stat="k1", rs_bound=1.5))
    assert name == "k1_step"
    assert keep.dtype == torch.bool and keep.shape == (3, 2)
    assert keep.float().tolist() == _keep("k1", "step", (1 / 1.5, 1.5))
    assert rejection_masks(log_w, RolloutCorrectionConfig()) == []  # no rejection: no criterion


def test_k1_bound_as_one_number_becomes_a_pair():
    assert RolloutCorrectionConfig(rs_stat="k1", rs_bound=4.0).rs_bound == (0.25, 4.0)
    assert RolloutCorrectionConfig(rs_stat="k1", rs_bound=[0.5, 3]).rs_bound == (0.5, 3.0)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"mode": "offline"}, "mode must be one of"),
        ({"level": "token"}, "level must be one of"),
        ({"is_kind": "clip"}, "is_kind must be one of"),
        ({"rs_stat": "k4", "rs_bound": 1.0}, "rs_stat must be one of"),
        ({"rs_stat": "k2", "rs_bound": 1.0, "rs_level": "seq"}, "rs_level must be one of"),
        ({"rs_bound": 1.0}, "rs_stat is null"),
        ({"rs_stat": "k3"}, "needs rs_bound"),
        ({"rs_stat": "k2", "rs_bound": [0.5, 2.0]}, "one number > 0"),
        ({"rs_stat": "k3", "rs_bound": -1.0}, "one number > 0"),
        ({"rs_stat": "k1", "rs_bound": [0.5, 1.0, 2.0]}, r"\[lo, hi\]"),
        ({"rs_stat": "k1", "rs_bound": 0.5}, "lo ≤ 1 ≤ hi"),
        ({"rs_stat": "k1", "rs_bound": [1.5, 2.0]}, "lo ≤ 1 ≤ hi"),
        ({"rs_stat": "k1", "rs_bound": 2.0, "rs_level": "max"}, "max is not defined for k1"),
    ],
)
def test_invalid_config_is_rejected(fields, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrectionConfig(**fields)


def test_input_shapes_and_values_are_checked():
    cfg = RolloutCorrectionConfig(mode="decoupled")
    with pytest.raises(ValueError, match=r"\[B, W\]"):
        correction_weights(torch.zeros(3), torch.zeros(3), cfg)
    with pytest.raises(ValueError, match=r"\[B, W\]"):
        correction_weights(torch.zeros(3, 2), torch.zeros(3, 3), cfg)
    with pytest.raises(ValueError, match="NaN or inf"):
        correction_weights(torch.tensor([[0.0, float("nan")]]), torch.zeros(1, 2), cfg)
