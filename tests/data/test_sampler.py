import pytest
import torch

from diffusion_rl.data.prompts import PromptRecord
from diffusion_rl.data.sampler import PromptSampler, StepPrompts, make_step_prompts
from diffusion_rl.errors import UserError


def stream(sampler: PromptSampler, num_epochs: int) -> list[int]:
    """The concatenated epoch orders: what consecutive steps must walk through."""
    return [i for e in range(num_epochs) for i in sampler.epoch_order(e)]


def test_same_seed_and_step_give_same_indices_in_any_order_of_calls():
    a = PromptSampler(num_prompts=10, prompts_per_step=4, seed=7)
    b = PromptSampler(num_prompts=10, prompts_per_step=4, seed=7)
    forward = [a.indices(step) for step in range(12)]
    backward = [b.indices(step) for step in reversed(range(12))][::-1]
    assert forward == backward


def test_different_seeds_give_different_orders():
    a = PromptSampler(num_prompts=50, prompts_per_step=50, seed=0)
    b = PromptSampler(num_prompts=50, prompts_per_step=50, seed=1)
    assert a.indices(0) != b.indices(0)


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = PromptSampler(num_prompts=30, prompts_per_step=6, seed=3)
    orders = [sampler.epoch_order(e) for e in range(4)]
    for order in orders:
        assert sorted(order) == list(range(30))
    assert len({tuple(o) for o in orders}) == 4
    # five steps of six cover epoch 0 exactly
    assert sorted(i for step in range(5) for i in sampler.indices(step)) == list(range(30))


def test_steps_crossing_an_epoch_boundary_take_end_of_one_epoch_and_start_of_next():
    sampler = PromptSampler(num_prompts=10, prompts_per_step=4, seed=11)
    epoch0, epoch1 = sampler.epoch_order(0), sampler.epoch_order(1)
    assert sampler.indices(2) == epoch0[8:10] + epoch1[0:2]
    assert sampler.indices(3) == epoch1[2:6]
    assert [sampler.epoch(s) for s in range(6)] == [0, 0, 0, 1, 1, 2]
    steps = [i for step in range(15) for i in sampler.indices(step)]
    assert steps == stream(sampler, 6)


def test_prompts_per_step_larger_than_dataset_spans_several_epochs():
    sampler = PromptSampler(num_prompts=3, prompts_per_step=7, seed=5)
    s = stream(sampler, 10)
    assert sampler.indices(0) == s[0:7]
    assert sampler.indices(1) == s[7:14]
    assert sampler.indices(2) == s[14:21]
    assert [sampler.epoch(step) for step in range(3)] == [0, 2, 4]


def test_no_shuffle_walks_the_dataset_in_order():
    sampler = PromptSampler(num_prompts=5, prompts_per_step=3, seed=99, shuffle=False)
    assert [sampler.indices(step) for step in range(4)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]


def test_single_prompt_dataset():
    sampler = PromptSampler(num_prompts=1, prompts_per_step=3, seed=0)
    assert sampler.indices(4) == [0, 0, 0]


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"num_prompts": 0, "prompts_per_step": 1, "seed": 0}, "num_prompts must be at least 1"),
        ({"num_prompts": 5, "prompts_per_step": 0, "seed": 0}, "prompts_per_step must be at least 1"),
        ({"num_prompts": 5, "prompts_per_step": 2, "seed": 0.5}, "seed must be an integer"),
    ],
)
def test_invalid_config(kwargs, expected):
    with pytest.raises(UserError, match=expected):
        PromptSampler(**kwargs)


def test_negative_step_is_rejected():
    with pytest.raises(UserError, match="step must be at least 0"):
        PromptSampler(4, 2, seed=0).indices(-1)


def test_state_dict_round_trip_on_matching_config():
    sampler = PromptSampler(num_prompts=8, prompts_per_step=2, seed=4, shuffle=True)
    state = sampler.state_dict()
    assert state == {"seed": 4, "num_prompts": 8, "prompts_per_step": 2, "shuffle": True}
    resumed = PromptSampler(num_prompts=8, prompts_per_step=2, seed=4)
    resumed.load_state_dict(state)
    assert resumed.indices(9) == sampler.indices(9)


def test_state_dict_mismatch_names_each_difference():
    state = PromptSampler(num_prompts=8, prompts_per_step=2, seed=4).state_dict()
    other = PromptSampler(num_prompts=9, prompts_per_step=3, seed=4)
    with pytest.raises(UserError) as err:
        other.load_state_dict(state)
    message = str(err.value)
    assert "num_prompts: checkpoint 8, now 9" in message
    assert "prompts_per_step: checkpoint 2, now 3" in message
    assert "seed:" not in message and "shuffle:" not in message


def test_state_dict_with_wrong_keys_is_rejected():
    with pytest.raises(UserError, match="expected"):
        PromptSampler(8, 2, seed=4).load_state_dict({"seed": 4})


# ---- StepPrompts ----


def make_records(n: int) -> list[PromptRecord]:
    return [
        PromptRecord(
            f"prompt {i}", ground_truth=f"gt {i}", data_source="even" if i % 2 == 0 else "odd", metadata={"i": i}
        )
        for i in range(n)
    ]


def test_step_prompts_repeat_each_prompt_group_size_times_consecutively():
    records = make_records(10)
    sampler = PromptSampler(num_prompts=10, prompts_per_step=3, seed=2)
    batch = make_step_prompts(records, sampler, step=4, group_size=2)
    chosen = sampler.indices(4)
    assert len(batch) == 6
    assert batch.num_groups == 3
    assert batch.prompt_index == [chosen[0], chosen[0], chosen[1], chosen[1], chosen[2], chosen[2]]
    assert batch.prompts == [records[i].prompt for i in batch.prompt_index]
    assert batch.uids == ["s4-p0", "s4-p0", "s4-p1", "s4-p1", "s4-p2", "s4-p2"]
    assert batch.group_index.dtype == torch.long
    assert batch.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert [m["ground_truth"] for m in batch.metadata] == [f"gt {i}" for i in batch.prompt_index]
    assert batch.negative_prompts == [None] * 6
    assert [m["data_source"] for m in batch.metadata] == [records[i].data_source for i in batch.prompt_index]


def test_uids_are_unique_across_steps_even_for_the_same_prompt():
    records = make_records(2)
    sampler = PromptSampler(num_prompts=2, prompts_per_step=2, seed=0)
    uids = [set(make_step_prompts(records, sampler, step, group_size=3).uids) for step in range(3)]
    assert not (uids[0] & uids[1]) and not (uids[1] & uids[2])


def test_metadata_includes_ground_truth_and_data_source_and_is_a_copy_per_instance():
    records = make_records(3)
    batch = make_step_prompts(records, PromptSampler(3, 1, seed=0, shuffle=False), step=1, group_size=2)
    metadata = batch.metadata
    assert metadata[0] == {"i": 1, "ground_truth": "gt 1", "data_source": "odd"}
    metadata[0]["i"] = 100
    assert metadata[1]["i"] == 1
    assert records[1].metadata == {"i": 1}


def test_make_step_prompts_checks_dataset_size_and_group_size():
    sampler = PromptSampler(num_prompts=5, prompts_per_step=2, seed=0)
    with pytest.raises(UserError, match="built for 5 prompts but the dataset has 4"):
        make_step_prompts(make_records(4), sampler, step=0, group_size=2)
    with pytest.raises(UserError, match="group_size must be at least 1"):
        make_step_prompts(make_records(5), sampler, step=0, group_size=0)


def test_step_prompts_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one per record"):
        StepPrompts(make_records(2), ["a"], torch.zeros(2, dtype=torch.long), [0, 1], step=0, group_size=1)


def test_sample_ids_of_selected_rows_keep_their_positions_in_the_step():
    records = [PromptRecord(f"p{i}") for i in range(3)]
    prompts = make_step_prompts(records, PromptSampler(3, 3, seed=0), step=4, group_size=2)  # B = 6
    whole = prompts.sample_ids([1, 4, 5])
    assert whole.sample_index.tolist() == [1, 4, 5]
    assert whole.group_index.tolist() == [0, 2, 2] and whole.policy_version.tolist() == [4, 4, 4]
    assert whole.prompt == [prompts.prompts[i] for i in (1, 4, 5)]
    part = prompts.select([4, 1, 5])  # what one Ray actor is sent: its rows, in the order given
    assert len(part) == 3 and part.prompts == [prompts.prompts[i] for i in (4, 1, 5)]
    ids = part.sample_ids([0, 1, 2])
    assert ids.sample_index.tolist() == [4, 1, 5] and ids.group_index.tolist() == [2, 0, 2]
    assert part.select([2]).sample_ids([0]).sample_index.tolist() == [5]  # a selection of a selection
