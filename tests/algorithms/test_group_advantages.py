import math

import pytest
import torch

from diffusion_rl.algorithms.credit import GroupNorm, compute_group_advantages, group_advantages

NAN = float("nan")
EPS = 1e-4

# Interleaved, non-contiguous group ids:
#   group 7: rewards 1, 2, 3 and one failed sample
#   group 3: rewards 5, 7
#   group 9: rewards 4, 4 (zero std)
#   group 5: reward 9 (singleton)
REWARDS = [1.0, 5.0, 2.0, NAN, 4.0, 9.0, 3.0, 7.0, 4.0]
GROUPS = [7, 3, 7, 7, 9, 5, 7, 3, 9]


def _std(values, ddof):
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - ddof))


def _hand(rewards, groups, global_std, ddof, normalize=True, eps=EPS):
    """Plain-python reference: loops over samples and groups."""
    valid = [i for i, r in enumerate(rewards) if not math.isnan(r)]
    members = {}
    for i in valid:
        members.setdefault(groups[i], []).append(rewards[i])
    batch_std = _std([rewards[i] for i in valid], ddof)
    out = []
    for i, r in enumerate(rewards):
        values = members.get(groups[i], [])
        if math.isnan(r) or len(values) < 2 or len(values) <= ddof or max(values) == min(values):
            out.append(0.0)
            continue
        dev = r - sum(values) / len(values)
        if not normalize:
            out.append(dev)
        else:
            out.append(dev / ((batch_std if global_std else _std(values, ddof)) + eps))
    return out


def _run(rewards=REWARDS, groups=GROUPS, **kwargs):
    return compute_group_advantages(torch.tensor(rewards), torch.tensor(groups), GroupNorm(**kwargs))


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("global_std", [True, False])
def test_matches_hand_computation(global_std, ddof):
    result = _run(global_std=global_std, std_ddof=ddof)
    expected = _hand(REWARDS, GROUPS, global_std, ddof)
    assert result.advantages.dtype == torch.float32
    torch.testing.assert_close(result.advantages, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_hand_worked_numbers_group_std():
    # Group 7 with ddof 1: mean 2, std 1 -> A = -1/(1+eps), 0, 1/(1+eps). Group 3: mean 6, std sqrt(2).
    adv = _run(global_std=False, std_ddof=1).advantages.tolist()
    assert adv[0] == pytest.approx(-1 / (1 + EPS))
    assert adv[2] == pytest.approx(0.0)
    assert adv[6] == pytest.approx(1 / (1 + EPS))
    assert adv[1] == pytest.approx(-1 / (math.sqrt(2) + EPS))
    assert adv[7] == pytest.approx(1 / (math.sqrt(2) + EPS))
    # Group 7 with ddof 0: std sqrt(2/3).
    adv0 = _run(global_std=False, std_ddof=0).advantages.tolist()
    assert adv0[0] == pytest.approx(-1 / (math.sqrt(2 / 3) + EPS))


def test_hand_worked_numbers_global_std():
    valid = [1.0, 5.0, 2.0, 4.0, 9.0, 3.0, 7.0, 4.0]  # mean 35/8
    mean = 35 / 8
    std0 = math.sqrt(sum((v - mean) ** 2 for v in valid) / 8)
    adv = _run(global_std=True, std_ddof=0).advantages.tolist()
    assert adv[1] == pytest.approx((5 - 6) / (std0 + EPS))
    assert adv[0] == pytest.approx((1 - 2) / (std0 + EPS))


def test_failed_singleton_and_zero_std_samples_get_zero():
    adv = _run().advantages.tolist()
    assert adv[3] == 0.0  # failed
    assert adv[5] == 0.0  # singleton group
    assert adv[4] == 0.0 and adv[8] == 0.0  # zero-std group


def test_failed_sample_is_left_out_of_group_statistics():
    # Same advantages for the other samples as in a batch where the failed sample was never drawn.
    adv = _run(global_std=False).advantages.tolist()
    expected = _hand(REWARDS[:3] + REWARDS[4:], GROUPS[:3] + GROUPS[4:], global_std=False, ddof=0)
    assert adv[:3] + adv[4:] == pytest.approx(expected, rel=1e-5)


def test_without_std_normalisation_advantage_is_reward_minus_group_mean():
    adv = _run(normalize_by_std=False).advantages.tolist()
    assert adv == pytest.approx([1 - 2, 5 - 6, 0.0, 0.0, 0.0, 0.0, 3 - 2, 7 - 6, 0.0])


def test_group_fractions():
    # Groups with a valid sample: 7, 3, 9, 5. Zero std: 9 and the singleton 5. Singleton: 5.
    metrics = _run().metrics
    assert metrics["advantage/zero_std_group_fraction"] == pytest.approx(2 / 4)
    assert metrics["advantage/singleton_group_fraction"] == pytest.approx(1 / 4)


def test_all_failed_group_is_not_counted_in_group_fractions():
    metrics = _run(REWARDS + [NAN, NAN], GROUPS + [11, 11]).metrics
    assert metrics["advantage/zero_std_group_fraction"] == pytest.approx(2 / 4)


def test_batch_metrics():
    result = _run()
    adv = result.advantages.tolist()
    mean = sum(adv) / len(adv)
    metrics = result.metrics
    assert metrics["advantage/mean"] == pytest.approx(mean, abs=1e-6)
    assert metrics["advantage/std"] == pytest.approx(math.sqrt(sum((a - mean) ** 2 for a in adv) / len(adv)))
    assert metrics["advantage/min"] == pytest.approx(min(adv))
    assert metrics["advantage/max"] == pytest.approx(max(adv))
    assert metrics["advantage/abs_mean"] == pytest.approx(sum(abs(a) for a in adv) / len(adv))


def test_singleton_with_ddof_one_is_zero_not_nan():
    result = _run([1.0, 2.0, 3.0], [0, 1, 2], global_std=False, std_ddof=1)
    assert result.advantages.tolist() == [0.0, 0.0, 0.0]


def test_advantage_options_are_checked_once_when_the_config_loads():
    from diffusion_rl.config import load
    from diffusion_rl.errors import UserError

    for bad in ("algorithm.advantage.std_ddof=-1", "algorithm.advantage.eps=-1e-3", "algorithm.advantage.eps=nan"):
        with pytest.raises(UserError, match="algorithm.advantage"):
            load(None, [bad])


def test_per_reward_aggregation_is_weighted_sum_of_per_reward_advantages():
    other = [0.5, 0.0, 1.5, 2.0, NAN, 1.0, 0.5, 1.0, 3.0]
    weights = {"a": 1.0, "b": 0.5}
    result = group_advantages(
        {"a": torch.tensor(REWARDS), "b": torch.tensor(other)},
        weights,
        torch.tensor(GROUPS),
        GroupNorm(global_std=False, std_ddof=0),
        itemize=True,
    )
    a = _hand(REWARDS, GROUPS, global_std=False, ddof=0)
    b = _hand(other, GROUPS, global_std=False, ddof=0)
    expected = [1.0 * x + 0.5 * y for x, y in zip(a, b)]
    torch.testing.assert_close(result.advantages, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    # In 'b', groups 9 (one failed) and 5 are singletons; in 'a' only group 5 is, and group 9 has zero std.
    assert result.metrics["advantage/b/singleton_group_fraction"] == pytest.approx(2 / 4)
    assert result.metrics["advantage/singleton_group_fraction"] == pytest.approx(1 / 4)  # group 5 only
    assert result.metrics["advantage/zero_std_group_fraction"] == pytest.approx(2 / 4)  # groups 9 and 5
    assert "advantage/a/mean" in result.metrics


def test_per_reward_aggregation_rejects_mismatched_names():
    with pytest.raises(ValueError, match="same rewards"):
        group_advantages({"a": torch.zeros(2)}, {"b": 1.0}, torch.tensor([0, 0]))
