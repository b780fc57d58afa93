"""engine.rollout=separate on CPU: rollout actors beside the trainers, weight pushes, sampling ahead, and runs that
survive a SIGKILL of a trainer or a rollout actor."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("ray")

from diffusion_rl.checkpoint.store import CheckpointManager  # noqa: E402
from diffusion_rl.errors import RunStopped  # noqa: E402
from diffusion_rl.tracking import read_metrics  # noqa: E402
from tests.engine.conftest import SEPARATE  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_session")

ROOT = Path(__file__).resolve().parents[2]
# the quickstart's Flow-GRPO with full fine-tuning, and DiffusionNFT with LoRA, which samples with its `old` adapter
# (trained on final latents: no window). One thread, 2 chunks of 2 rows: see EQUAL in conftest.py.
NFT = ("train.lr=1e-4", "engine.num_threads=1", "sampling.score_chunks=2", "model.lora.enabled=true")
RUNS = {
    "flow_grpo-full-object_store": ("quickstart_flow_grpo.yaml", ()),
    "nft-lora-broadcast": ("quickstart_nft.yaml", (*NFT, "engine.weight_sync=broadcast")),
}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_separate_rollout_actors_in_step_take_the_same_steps_as_colocated_workers(
    make_config, tmp_path, run_trainer, rows_close, max_difference, ray_overrides, equal_overrides, run
):
    config, equal = RUNS[run]
    options = (*(equal or equal_overrides), *ray_overrides, "engine.num_workers=2", "train.total_steps=3")
    config = ROOT / "configs" / config
    colocated, colocated_rows = run_trainer(make_config(*options, f"run.dir={tmp_path / 'colocated'}", config=config))
    colocated_weights = colocated.engine.trainable_state_dict()
    colocated.engine.close()
    separate, separate_rows = run_trainer(make_config(*options, *SEPARATE, config=config))
    # the rollout actor samples each chunk's 2 rows as a colocated worker does: the same images, bit for bit
    for colocated_row, separate_row in zip(colocated_rows, separate_rows, strict=True):
        assert separate_row["reward/mean"] == colocated_row["reward/mean"]
        rows_close(colocated_row, separate_row, rel=1e-4)
        assert separate_row["rollout/weights_version"] == separate_row["step"]  # pushed after every update
        assert separate_row["sync/bytes"] > 0 and separate_row["timing/weight_push"] > 0
        # prompts and targets (at step 1 also the actors' setup: the run's config, ~2 KB per actor), never a
        # trajectory or the weights (sync/bytes: they go worker to worker)
        assert separate_row["driver/bytes_out"] < min(20_000, separate_row["sync/bytes"] / 10)
    assert max_difference(colocated_weights, separate.engine.trainable_state_dict()) <= 1e-5


def test_rollouts_sampled_one_step_ahead_are_one_version_stale_and_corrected(
    make_config, run_trainer, ray_overrides, equal_overrides
):
    cfg = make_config(*equal_overrides, *ray_overrides, *SEPARATE, "engine.num_workers=1", "engine.max_staleness=1",
                      "train.total_steps=3")  # fmt: skip
    assert cfg.algorithm.rollout_correction.mode == "decoupled"  # turned on: rows may be stale
    trainer, rows = run_trainer(cfg)
    first, *later = rows
    # step 1 had nothing to sample ahead of it; steps 2 and 3 were sampled while the previous update ran
    assert first["rollout/staleness_max"] == 0 and "timing/sampled_ahead" not in first
    assert first["rollout_corr/is_weight_std"] == 0  # on-policy: every IS weight is 1
    for row in later:
        assert row["rollout/staleness_1_fraction"] == 1.0 and row["rollout/staleness_max"] == 1.0
        assert row["timing/sampled_ahead"] > 0
        assert row["rollout_corr/is_weight_std"] > 0  # the stale rows are weighted by π_old / π_rollout
        assert 0 < row["rollout_corr/weight_mean"] <= cfg.algorithm.rollout_correction.threshold


def _kill_before(trainer, deaths: dict) -> None:
    """SIGKILL the process deaths[i](trainer) when step i (0-based) starts, once per step."""
    train_step = trainer.train_step
    done = set()

    def step_after_deaths(index: int):
        if index in deaths and index not in done:
            done.add(index)
            os.kill(deaths[index](trainer), signal.SIGKILL)
        return train_step(index)

    trainer.train_step = step_after_deaths


def test_a_run_survives_a_killed_rollout_actor_and_a_killed_trainer_and_ends_as_a_straight_run(
    make_config, tmp_path, run_trainer, max_difference, ray_overrides, equal_overrides
):
    options = (*equal_overrides, *ray_overrides, *SEPARATE, "engine.num_workers=1", "train.total_steps=3",
               "train.save_every=1")  # fmt: skip
    # straight: the same run with nobody killed. (Not the local engine's run: its first update differs from the Ray
    # trainer's by float reduction order, which on an AMX CPU rounds a pixel of step 2's images the other way, one
    # JPEG byte, and the runs part by ~3·lr.)
    straight, straight_rows = run_trainer(make_config(*options, f"run.dir={tmp_path / 'straight'}"))
    straight_weights = straight.engine.trainable_state_dict()
    straight.engine.close()
    # step 2: the rollout actor dies, new ones sample step 2 again; step 3: the trainer dies, a new engine resumes
    # from the checkpoint of step 2
    deaths = {1: lambda t: t.engine.rollouts.pids[0], 2: lambda t: t.engine.trainers.pids[0]}
    recovered, rows = run_trainer(make_config(*options, f"run.dir={tmp_path / 'recovered'}"),
                                  prepare=lambda t: _kill_before(t, deaths))  # fmt: skip
    assert [r["step"] for r in rows] == [1, 2, 3]  # each once: nothing logged twice
    assert [r.get("engine/failures") for r in rows] == [None, 1, 2]
    assert rows[1]["timing/recovery"] > 0 and rows[2]["timing/recovery"] > 0
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in straight_rows]  # the same images
    assert max_difference(straight_weights, recovered.engine.trainable_state_dict()) <= 1e-7


def test_after_max_failures_the_run_stops_naming_the_cause_and_keeps_its_checkpoint(
    make_config, tmp_path, run_trainer, ray_overrides
):
    cfg = make_config(*ray_overrides, "engine.num_workers=2", "engine.max_failures=0", "train.total_steps=3",
                      "train.save_every=1")  # fmt: skip
    with pytest.raises(RunStopped, match=r"worker rank 1 .* died.*engine.max_failures=0") as stopped:
        run_trainer(cfg, prepare=lambda t: _kill_before(t, {1: lambda t: t.engine.trainers.pids[1]}))
    assert "latest checkpoint (the last healthy one)" in str(stopped.value)
    checkpoints = CheckpointManager(cfg.run.dir)
    assert [step for step, _ in checkpoints.list()] == [1]
    assert [r["step"] for r in read_metrics(cfg.run.dir)] == [1]


def test_bf16_rollout_actors_sample_for_fp32_trainers_and_the_mismatch_is_measured(
    make_config, run_trainer, ray_overrides
):
    cfg = make_config(*ray_overrides, *SEPARATE, "engine.num_workers=1", "engine.rollout_dtype=bf16",
                      "algorithm.rollout_correction.mode=decoupled", "train.total_steps=1")  # fmt: skip
    trainer, (row,) = run_trainer(cfg)
    # on-policy weights, but bf16 sampling against an fp32 recomputation: log-probs differ a little, and the IS
    # weights π_old / π_rollout correct for it
    assert 0 < row["rollout_corr/abs_dlogp_mean"] < 0.5
    assert row["rollout_corr/is_weight_std"] > 0 and abs(row["rollout_corr/is_weight_mean"] - 1) < 0.2
