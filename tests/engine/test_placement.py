"""Placing an update's units on workers: balanced shares, units kept where their rows are, the rest moved."""

from __future__ import annotations

from diffusion_rl.engine.placement import place_units


def test_rows_stay_where_they_were_sampled_when_the_shares_are_even():
    shares, pad_to = place_units([[r] for r in range(8)], [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert pad_to == 4
    assert [s.local for s in shares] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(s.imported == {} and not s.padding_only for s in shares)


def test_pairs_split_over_two_workers_move_one_row_each_and_balance():
    # offline DPO: chosen rows 0-1 on worker 0, rejected rows 2-3 on worker 1; pairs (0, 2) and (1, 3)
    shares, pad_to = place_units([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    assert pad_to == 1
    first, second = shares
    assert first.rows == [0, 2] and first.imported == {1: [2]}
    assert second.rows == [3, 1] and second.imported == {0: [1]}


def test_unbalanced_pairs_move_to_the_worker_with_room():
    # three pairs all sampled on worker 0: 2 stay, 1 moves (both rows) to worker 1
    shares, pad_to = place_units([[0, 1], [2, 3], [4, 5]], [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    assert pad_to == 2
    assert shares[0].rows == [0, 1, 2, 3] and shares[1].rows == [4, 5] and shares[1].imported == {0: [4, 5]}


def test_fewer_units_than_workers_pad_the_idle_worker_with_a_copy():
    shares, pad_to = place_units([[0, 1]], [[0, 1], [2, 3]])
    assert pad_to == 1
    assert shares[0].rows == [0, 1] and not shares[0].padding_only
    assert shares[1].padding_only and shares[1].imported == {0: [0, 1]}


def test_no_unit_at_all_pads_nothing():
    shares, pad_to = place_units([], [[0, 1], [2, 3]])
    assert pad_to == 0 and all(s.rows == [] and not s.padding_only for s in shares)


def test_rows_of_rollout_actors_all_move_to_the_trainers_in_even_shares():
    # 2 trainers (sources 0, 1) hold nothing; rollout actors (sources 2, 3) sampled rows 0-3 and 4-7; DPO pairs
    unit_rows = [[0, 4], [1, 5], [2, 6]]
    shares, pad_to = place_units(unit_rows, [[], [], [0, 1, 2, 3], [4, 5, 6, 7]], trainers=2)
    assert pad_to == 2 and len(shares) == 2
    assert shares[0].local == [] and shares[0].imported == {2: [0, 1], 3: [4, 5]}
    assert shares[0].rows == [0, 1, 4, 5]  # by source, then in unit order: the targets follow this order
    assert shares[1].imported == {2: [2], 3: [6]} and shares[1].rows == [2, 6]
