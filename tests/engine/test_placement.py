"""Placing an update's units on workers: balanced shares, units kept where their rows are, the rest moved."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.engine.ray import place_units
from diffusion_rl.engine.ray_cluster import check_layout_fits
from diffusion_rl.trainer.setup import worker_spec

ROOT = Path(__file__).resolve().parents[2]


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


def test_a_layout_the_cluster_cannot_hold_is_refused_in_one_line_before_any_wait():
    from diffusion_rl.config import EngineConfig
    from diffusion_rl.errors import UserError

    separate = EngineConfig(kind="ray", num_workers=2, rollout="separate")  # the documented 2-CPU machine: 3 CPUs
    with pytest.raises(UserError) as error:
        check_layout_fits(separate, {"CPU": 2.0, "memory": 1e9})
    message = str(error.value)
    assert "\n" not in message and message.startswith(
        "engine: the Ray layout needs 3 CPU (2 trainers × 1 + 1 rollout actor × 1) but the cluster has 2: lower "
        "engine.cpus_per_worker / cpus_per_rollout_worker"
    )
    check_layout_fits(separate, {"CPU": 3.0})  # fits: no error
    half = EngineConfig(kind="ray", num_workers=2, rollout="separate", cpus_per_worker=0.5, cpus_per_rollout_worker=1)
    check_layout_fits(half, {"CPU": 2.0})
    gpus = EngineConfig(kind="ray", num_workers=2, gpus_per_worker=1, trainer_resources={"trainer_node": 1})
    with pytest.raises(
        UserError, match=r"needs 2 GPU \(2 trainers × 1\) but the cluster has 0: .*; and 2 trainer_node"
    ):
        check_layout_fits(gpus, {"CPU": 16.0})


def test_the_ray_engine_checks_the_layout_before_starting_actors(monkeypatch):
    from diffusion_rl.config import load
    from diffusion_rl.engine import ray as ray_engine
    from diffusion_rl.engine import ray_cluster
    from diffusion_rl.errors import UserError

    class FakeRay:
        @staticmethod
        def cluster_resources():
            return {"CPU": 2.0}

    started = []
    monkeypatch.setattr(ray_engine, "ensure_ray", lambda e: None)
    monkeypatch.setattr(ray_cluster, "import_ray", lambda local=False: FakeRay)
    monkeypatch.setattr(ray_engine.RayEngine, "_start_trainers", lambda self: started.append(1))
    cfg = load(
        str(ROOT / "configs/quickstart_flow_grpo.yaml"),
        ["engine.kind=ray", "engine.num_workers=2", "engine.rollout=separate"],
    )
    with pytest.raises(UserError, match="needs 3 CPU"):
        ray_engine.RayEngine(cfg.engine, worker_spec(cfg))
    assert not started
