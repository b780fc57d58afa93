import math

import pytest
import torch

from diffusion_rl.algorithms.preference.dpo import online_pairs

NAN = math.nan


def _pairs(rewards, groups):
    out = online_pairs(torch.tensor(rewards), torch.tensor(groups))
    return out.chosen.tolist(), out.rejected.tolist(), out.metrics


def test_best_and_worst_of_each_group_in_first_appearance_order():
    chosen, rejected, metrics = _pairs([1.0, 3.0, 2.0, 5.0, 4.0, 4.5], [7, 7, 7, 2, 2, 2])
    assert chosen == [1, 3] and rejected == [0, 4]
    assert metrics["pairs/count"] == 2 and metrics["pairs/skipped_groups"] == 0
    assert metrics["pairs/reward_gap"] == pytest.approx(((3 - 1) + (5 - 4)) / 2)


def test_interleaved_groups_keep_first_appearance_order():
    chosen, rejected, _ = _pairs([0.0, 9.0, 1.0, 8.0], [5, 1, 5, 1])
    assert list(zip(chosen, rejected)) == [(2, 0), (1, 3)]


def test_ties_take_the_earliest_max_and_the_latest_min():
    chosen, rejected, _ = _pairs([1.0, 2.0, 1.0, 2.0, 1.5], [0, 0, 0, 0, 0])
    assert chosen == [1] and rejected == [2]


def test_all_equal_and_too_small_groups_are_skipped():
    chosen, rejected, metrics = _pairs(
        [1.0, 1.0, 1.0, 4.0, 0.0, 2.0, NAN, NAN, NAN],
        [0, 0, 0, 1, 2, 2, 3, 3, 4],
    )
    assert chosen == [5] and rejected == [4]
    assert metrics["pairs/groups"] == 5
    assert metrics["pairs/tied_groups"] == 1  # group 0
    assert metrics["pairs/too_small_groups"] == 3  # group 1 (one sample), group 3 (all failed), group 4
    assert metrics["pairs/skipped_groups"] == 4
    assert metrics["pairs/failed_samples"] == 3


def test_failed_samples_are_never_paired():
    chosen, rejected, metrics = _pairs([NAN, 5.0, NAN, 1.0, math.inf, 2.0, NAN], [0, 0, 0, 0, 1, 1, 1])
    assert chosen == [1] and rejected == [3]
    assert metrics["pairs/too_small_groups"] == 1  # group 1 keeps only 2.0
    assert metrics["pairs/failed_samples"] == 4


def test_no_pairs_gives_empty_long_tensors():
    out = online_pairs(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    assert out.chosen.dtype == torch.long and out.chosen.shape == (0,)
    assert out.rejected.shape == (0,) and out.metrics["pairs/count"] == 0


def test_chosen_reward_beats_rejected_reward_on_random_batches():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        rewards = torch.randint(0, 4, (24,), generator=gen).double()  # many ties
        rewards[torch.rand(24, generator=gen) < 0.2] = NAN
        groups = torch.randint(0, 6, (24,), generator=gen)
        out = online_pairs(rewards, groups)
        for c, r in zip(out.chosen.tolist(), out.rejected.tolist()):
            assert groups[c] == groups[r]
            assert rewards[c] > rewards[r]
            valid = [i for i in range(24) if groups[i] == groups[c] and not math.isnan(rewards[i])]
            assert rewards[c] == max(rewards[i] for i in valid)
            assert rewards[r] == min(rewards[i] for i in valid)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="group_ids"):
        online_pairs(torch.zeros(3), torch.zeros(2, dtype=torch.long))
