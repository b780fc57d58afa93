"""Rollout correction's batch-normalised IS weights, chained rejection criteria and off-policy diagnostics, against
numbers worked out with plain Python loops over the same log w."""

import math
from pathlib import Path

import pytest
import torch

from diffusion_rl.algorithms.rollout_correction import (
    RejectionCriterion,
    RolloutCorrectionConfig,
    correction_weights,
    offpolicy_metrics,
)
from diffusion_rl.config import load
from diffusion_rl.errors import UserError

ROOT = Path(__file__).resolve().parents[2]

# log w = logp_old - logp_rollout for 3 samples x 2 steps
LOG_W = [[0.1, -0.2], [1.0, 0.5], [-1.0, 0.3]]
ROLLOUT = [[-1.0, -2.0], [-3.0, -1.5], [-0.5, -2.5]]


def _run(log_w=LOG_W, **cfg):
    rollout = torch.tensor(ROLLOUT)
    return correction_weights(rollout + torch.tensor(log_w), rollout, RolloutCorrectionConfig(**cfg))


def _flat(rows):
    return [x for row in rows for x in row]


def test_batch_normalised_step_weights_average_one():
    tis = [min(math.exp(x), 2.0) for x in _flat(LOG_W)]  # e^1.0 = 2.72 is truncated to 2
    mean = sum(tis) / len(tis)
    out = _run(mode="decoupled", is_batch_normalize=True)
    assert _flat(out.weights_BW.tolist()) == pytest.approx([w / mean for w in tis], rel=1e-6)
    assert out.metrics["rollout_corr/is_batch_norm_factor"].item() == pytest.approx(mean, rel=1e-6)
    assert out.metrics["rollout_corr/is_weight_mean"].item() == pytest.approx(1.0, rel=1e-6)


def test_batch_normalised_sequence_weights_average_one_over_samples():
    # row sums -0.1, 1.5, -0.7 → e^-0.1, min(e^1.5, 2) = 2, e^-0.7: one weight per sample
    per_sample = [math.exp(-0.1), 2.0, math.exp(-0.7)]
    mean = sum(per_sample) / 3
    out = _run(mode="decoupled", level="sequence", is_batch_normalize=True)
    assert _flat(out.weights_BW.tolist()) == pytest.approx([w / mean for w in per_sample for _ in "ab"], rel=1e-6)


def test_batch_normalisation_comes_before_rejection():
    # k2 ≤ 0.1 rejects the steps with |log w| > 0.447: 1.0, 0.5 and -1.0; the mean is over all six IS weights
    tis = [min(math.exp(x), 2.0) for x in _flat(LOG_W)]
    mean = sum(tis) / 6
    keep = [1.0 if 0.5 * x * x <= 0.1 else 0.0 for x in _flat(LOG_W)]
    assert keep == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    out = _run(mode="decoupled", is_batch_normalize=True, rs_stat="k2", rs_bound=0.1)
    assert _flat(out.weights_BW.tolist()) == pytest.approx([w / mean * k for w, k in zip(tis, keep)], rel=1e-6)


def test_batch_normalisation_leaves_all_zero_weights_alone():
    # IcePop with a band that drops every weight: mean 0, no division
    out = _run([[3.0, 3.0], [-3.0, 3.0], [3.0, -3.0]], mode="decoupled", is_kind="icepop", is_batch_normalize=True)
    assert out.weights_BW.tolist() == [[0.0, 0.0]] * 3
    assert out.metrics["rollout_corr/is_batch_norm_factor"].item() == 1.0


def _hand_keep(stat, level, bound, log_w=LOG_W):
    rows = []
    for row in log_w:
        values = {"k1": [-x for x in row], "k2": [0.5 * x * x for x in row],
                  "k3": [math.exp(x) - 1 - x for x in row]}[stat]  # fmt: skip

        def ok(v):
            return math.log(bound[0]) <= v <= math.log(bound[1]) if stat == "k1" else v <= bound

        if level == "step":
            rows.append([1.0 if ok(v) else 0.0 for v in values])
        else:
            agg = {"sum": sum(values), "mean": sum(values) / len(values), "max": max(values)}[level]
            rows.append([1.0 if ok(agg) else 0.0] * len(values))
    return rows


def test_chained_criteria_keep_an_entry_only_when_it_passes_every_one():
    first = _hand_keep("k1", "step", (0.25, 4.0))  # |log w| ≤ 1.386: every step passes
    second = _hand_keep("k3", "mean", 0.1)  # row means of k3: 0.0101, 0.3307, 0.1418 → only row 0 passes
    third = _hand_keep("k2", "step", 0.04)  # |log w| ≤ 0.283: 0.1 and -0.2 only
    assert first == [[1.0, 1.0]] * 3 and second == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    assert third == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    cfg = dict(rs_stat="k1", rs_bound=4.0, rs_chain=[{"stat": "k3", "bound": 0.1, "level": "mean"},
                                                      {"stat": "k2", "bound": 0.04}])  # fmt: skip
    out = _run(**cfg)
    expected = [[a * b * c for a, b, c in zip(ra, rb, rc)] for ra, rb, rc in zip(first, second, third)]
    assert out.weights_BW.tolist() == expected
    m = out.metrics
    assert m["rollout_corr/rejected_fraction"].item() == pytest.approx(4 / 6)
    assert m["rollout_corr/rejected_fraction/k1_step"].item() == 0.0
    assert m["rollout_corr/rejected_fraction/k3_mean"].item() == pytest.approx(4 / 6)
    assert m["rollout_corr/rejected_fraction/k2_step"].item() == pytest.approx(4 / 6)


def test_a_chain_where_each_criterion_rejects_different_entries():
    # k1 within [1/1.5, 1.5] rejects |log w| > 0.405 per step; k2 sum ≤ 0.1 rejects rows 1 and 2 as a whole
    a, b = _hand_keep("k1", "step", (1 / 1.5, 1.5)), _hand_keep("k2", "sum", 0.1)
    assert a == [[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]] and b == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    cfg = RolloutCorrectionConfig(mode="bypass", rs_stat="k1", rs_bound=1.5,
                                  rs_chain=[RejectionCriterion(stat="k2", bound=0.1, level="sum")])  # fmt: skip
    log_w = torch.tensor(LOG_W)
    keep = correction_weights(log_w, torch.zeros_like(log_w), cfg).weights_BW  # bypass: weight 1 where kept, else 0
    assert keep.tolist() == [[x * y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def test_chain_entries_are_checked_like_the_first_criterion():
    assert RejectionCriterion(stat="k1", bound=2.0).bound == (0.5, 2.0)
    with pytest.raises(ValueError, match="rs_chain entry: k1 rs_bound needs"):
        RolloutCorrectionConfig(rs_stat="k2", rs_bound=1.0, rs_chain=[{"stat": "k1", "bound": [2.0, 3.0]}])
    with pytest.raises(ValueError, match="needs rs_bound"):
        RolloutCorrectionConfig(rs_stat="k2", rs_bound=1.0, rs_chain=[{"stat": "k3"}])
    with pytest.raises(ValueError, match="max is not defined for k1"):
        RolloutCorrectionConfig(rs_stat="k2", rs_bound=1.0, rs_chain=[{"stat": "k1", "bound": 2.0, "level": "max"}])
    with pytest.raises(ValueError, match="set rs_stat"):
        RolloutCorrectionConfig(rs_chain=[{"stat": "k3", "bound": 0.1}])


def test_the_config_reads_a_chain_and_refuses_a_window_level_entry_in_bypass_mode():
    chain = "algorithm.rollout_correction.rs_chain=[{stat: k3, bound: 0.1, level: mean}]"
    first = ("algorithm.rollout_correction.rs_stat=k2", "algorithm.rollout_correction.rs_bound=0.5")
    cfg = load(
        ROOT / "configs/quickstart_flow_grpo.yaml", [*first, chain, "algorithm.rollout_correction.mode=decoupled"]
    )
    (entry,) = cfg.algorithm.rollout_correction.rs_chain
    assert (entry.stat, entry.bound, entry.level) == ("k3", 0.1, "mean")
    with pytest.raises(UserError, match="rs_level=mean .criterion k3_mean."):
        load(ROOT / "configs/quickstart_flow_grpo.yaml", [*first, chain])


def test_offpolicy_diagnostics_match_a_plain_loop():
    flat = _flat(LOG_W)
    kl = sum(-x for x in flat) / 6
    k3 = sum(math.exp(x) - 1 - x for x in flat) / 6
    chi2_step = sum(math.exp(2 * x) for x in flat) / 6 - 1
    ppl_ratio = sum(math.exp(-sum(row) / len(row)) for row in LOG_W) / 3
    chi2_seq = sum(math.exp(2 * sum(row)) for row in LOG_W) / 3 - 1
    m = _run(mode="decoupled").metrics
    assert m["rollout_corr/kl"].item() == pytest.approx(kl, rel=1e-6)
    assert m["rollout_corr/k3_kl"].item() == pytest.approx(k3, rel=1e-6)
    assert m["rollout_corr/chi2_step"].item() == pytest.approx(chi2_step, rel=1e-6)
    assert m["rollout_corr/ppl_ratio"].item() == pytest.approx(ppl_ratio, rel=1e-6)
    assert m["rollout_corr/chi2_seq"].item() == pytest.approx(chi2_seq, rel=1e-6)
    # hand values: kl = -0.7/6, chi2_seq = (e^-0.2 + e^3 + e^-1.4)/3 - 1
    assert kl == pytest.approx(-0.116667, abs=1e-6) and chi2_seq == pytest.approx(6.0503, abs=1e-4)


def test_offpolicy_diagnostics_are_zero_on_policy_and_finite_far_off_it():
    zero = offpolicy_metrics(torch.zeros(4, 3))
    assert zero.pop("rollout_corr/ppl_ratio").item() == 1.0  # equal perplexities
    assert all(v.item() == 0.0 for v in zero.values())
    far = offpolicy_metrics(torch.tensor([[30.0, 30.0], [-40.0, 0.0]]))
    assert all(math.isfinite(v.item()) for v in far.values())
    # the step form only has no sequence statistics
    assert set(offpolicy_metrics(torch.zeros(2, 1), sequence=False)) == {
        "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_step"
    }  # fmt: skip
