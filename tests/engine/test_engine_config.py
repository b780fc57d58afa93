"""engine.kind=ray settings that cannot work are config errors, and the driver's row split (no Ray needed)."""

from __future__ import annotations

import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.utils.split import chunks_of_shares, split_evenly


def test_workers_must_split_the_batch_into_whole_minibatch_shards(make_config):
    # batch 2 × 2 = 4: 2 workers of 2 rows each fit 1 or 2 mini-batches, 3 workers do not divide it at all
    assert make_config("engine.kind=ray", "engine.num_workers=2", "train.num_minibatches=2").engine.num_workers == 2
    with pytest.raises(UserError, match=r"engine.num_workers=3: .*pick num_workers dividing 4"):
        make_config("engine.kind=ray", "engine.num_workers=3")
    # 4 workers get one row each, which cannot hold 2 interleaved mini-batches
    with pytest.raises(UserError, match=r"engine.num_workers=4: .*train.num_minibatches=2"):
        make_config("engine.kind=ray", "engine.num_workers=4", "train.num_minibatches=2")
    assert make_config("engine.num_workers=3").engine.kind == "local"  # ignored by the local engine


def test_ray_engine_settings_are_checked(make_config):
    with pytest.raises(UserError, match="engine.address='localhost'"):
        make_config("engine.address=localhost")
    with pytest.raises(UserError, match=r"'engine.num_workers' must be in \[1, 4096\], got 0"):
        make_config("engine.num_workers=0")
    assert make_config("engine.kind=ray", "algorithm.loss=dpo", "sampling.sde_type=ode").engine.kind == "ray"
    with pytest.raises(UserError, match=r"'rewards.0.actors' must be in \[0, 1024\], got -1"):
        make_config("rewards.0.actors=-1")


def test_separate_rollout_settings_are_checked_and_stale_rows_turn_on_decoupled_correction(make_config):
    separate = ("engine.kind=ray", "engine.rollout=separate")
    with pytest.raises(UserError, match="engine.rollout=separate .* needs engine.kind=ray"):
        make_config("engine.rollout=separate")
    with pytest.raises(UserError, match="engine.max_staleness and engine.sync_every are for engine.rollout=separate"):
        make_config("engine.kind=ray", "engine.max_staleness=1")
    with pytest.raises(UserError, match=r"'engine.rollout_workers' must be in \[1, 4096\], got 0"):
        make_config(*separate, "engine.rollout_workers=0")
    with pytest.raises(UserError, match="offline pairs .* train with engine.rollout=colocated"):
        make_config(*separate, "algorithm.loss=dpo", "data.sample_source=offline", "data.pairs=pairs.jsonl",
                    "sampling.sde_type=ode", "rewards=[]")  # fmt: skip
    synchronous = make_config(*separate)
    assert synchronous.engine.staleness_bound == 0 and synchronous.algorithm.rollout_correction.mode == "bypass"
    ahead = make_config(*separate, "engine.max_staleness=1", "engine.sync_every=2")
    assert ahead.engine.staleness_bound == 2  # sampled 1 step ahead by weights pushed every 2 updates
    assert ahead.algorithm.rollout_correction.mode == "decoupled"
    nft = make_config(*separate, "engine.max_staleness=1", "algorithm.loss=nft", "sampling.sde_type=ode")
    assert nft.algorithm.rollout_correction.mode == "bypass"  # no log-probs to correct: trains on stale rows as is


def test_rows_are_split_into_contiguous_near_equal_shares():
    assert split_evenly(list(range(8)), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_evenly([4, 5, 6], 2) == [[4, 5], [6]]
    assert split_evenly([7], 3) == [[7], [], []]  # a worker may get no rows (it still joins the all-gather)


def test_sampling_chunks_give_every_sampler_a_piece_of_its_rows():
    # 8 rows on 2 workers (0-3, 4-7) in 2 chunks: each chunk samples on both
    assert chunks_of_shares(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # one worker: contiguous chunks, as the local engine always sampled
    assert chunks_of_shares(7, 1, 3) == split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    # wan22_ti2v_5b_dance_lora: 512 rows, 8 workers, 16 chunks: 4 rows of every worker a chunk (was 32 of one)
    first = chunks_of_shares(512, 8, 16)[0]
    assert first == [row for w in range(8) for row in range(64 * w, 64 * w + 4)]
    assert sorted(r for c in chunks_of_shares(512, 8, 16) for r in c) == list(range(512))
