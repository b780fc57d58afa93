"""What goes wrong during training: failing rewards, non-finite updates, bad prompt files and config keys."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_rl.checkpoint.state import read_saved_tensors
from diffusion_rl.checkpoint.store import CheckpointManager
from diffusion_rl.config import load
from diffusion_rl.engine.optimizer import TrainingDiverged
from diffusion_rl.errors import UserError
from diffusion_rl.rewards import RewardFailure
from diffusion_rl.tracking import read_metrics


def _record_targets(trainer) -> list[tuple]:
    """Keep each step's (scored rewards [B], the targets the algorithm prepared from them)."""
    calls = []
    prepare = trainer.algorithm.prepare

    def record(scored, group_index):
        targets, metrics = prepare(scored, group_index)
        calls.append((torch.from_numpy(scored.total.copy()), targets.clone()))
        return targets, metrics

    trainer.algorithm.prepare = record
    return calls


@pytest.mark.filterwarnings("error::RuntimeWarning")  # e.g. numpy's all-NaN slice in validation's best@n
def test_samples_whose_reward_raises_get_advantage_0_and_the_step_completes(make_trainer, user_reward):
    # Each step: the batch call raises, then the one-by-one retry raises on its 4th sample. One group of 4, so
    # the 3 scored samples still have a group to compare with.
    spec = user_reward(
        """
        scores = []
        for image in images:
            CALLS[0] += 1
            if CALLS[0] % 4 == 0:
                raise ValueError("cannot score this image")
            scores.append(image.mean() / 255)
        return np.array(scores, dtype=np.float32)
        """
    )
    trainer = make_trainer(f"rewards.0.name={spec}", "data.prompts_per_step=1", "data.group_size=4", "val.every=2")
    calls = _record_targets(trainer)
    rows = trainer.train()

    assert [r["step"] for r in rows] == [1, 2]
    for row, (rewards, targets) in zip(rows, calls):
        failed = torch.isnan(rewards)
        assert failed.tolist() == [False, False, False, True]
        assert torch.all(targets.advantages[failed] == 0)
        assert torch.all(targets.advantages[~failed] != 0)
        assert row["reward/failed_fraction"] == 0.25
        assert math.isfinite(row["reward/mean"]) and math.isfinite(row["loss"])
        assert row["train/optimizer_steps"] >= 1
    # validation at the end: 4 prompts × 1 sample, the 4th fails the same way and is left out of best@n
    assert rows[-1]["val/reward/failed_fraction"] == 0.25
    assert math.isfinite(rows[-1]["val/reward/best@n"])


def test_reward_failing_every_sample_stops_the_run_and_keeps_the_last_checkpoint(make_trainer, user_reward, weights):
    spec = user_reward(
        """
        CALLS[0] += 1
        if CALLS[0] > 1:  # the first step's batch call scores; everything after fails
            raise RuntimeError("scorer is down")
        return images.mean(axis=(1, 2, 3)).astype(np.float32) / 255
        """
    )
    trainer = make_trainer(f"rewards.0.name={spec}", "train.total_steps=3", "train.save_every=1")
    with pytest.raises(RewardFailure, match="scorer is down") as failure:
        trainer.train()
    assert spec in str(failure.value)

    checkpoints = CheckpointManager(trainer.run_dir)
    assert checkpoints.latest() == checkpoints.dir / "step_000001"
    assert [step for step, _ in checkpoints.list()] == [1]
    assert sorted(p.name for p in checkpoints.dir.iterdir()) == ["latest", "step_000001"]  # no half-written dir
    saved = read_saved_tensors(checkpoints.latest(), "policies.default.")
    now = weights(trainer)  # the failing step never reached its update
    assert all(torch.equal(saved[k], now[k]) for k in now)
    assert [r["step"] for r in read_metrics(trainer.run_dir)] == [1]


def _nan_loss(worker) -> None:
    loss_fn = worker.algorithm.loss_fn

    def nan(inp, cfg):
        out = loss_fn(inp, cfg)
        out.loss = out.loss * float("nan")
        return out

    worker.algorithm.loss_fn = nan


def test_non_finite_updates_are_skipped_then_stop_the_run_with_latest_on_the_last_healthy_step(make_trainer, weights):
    options = ("train.save_every=1", "train.keep_last=0", "train.max_consecutive_skips=2")
    make_trainer(*options, "train.total_steps=1").train()

    trainer = make_trainer(*options, "train.total_steps=5")
    _nan_loss(trainer.engine.worker)
    with pytest.raises(TrainingDiverged, match="2 consecutive"):
        trainer.train()

    rows = read_metrics(trainer.run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/skipped_updates"] == 0 and rows[0]["train/optimizer_steps"] == 1
    assert rows[1]["train/skipped_updates"] == 1 and rows[1]["train/optimizer_steps"] == 1
    assert rows[1]["grad_norm"] is None  # non-finite: stored as null

    # step 2's update was skipped: its checkpoint is not published, `latest` stays on step 1
    checkpoints = CheckpointManager(trainer.run_dir)
    assert [step for step, _ in checkpoints.list()] == [1]
    assert checkpoints.latest().name == "step_000001"
    step1 = read_saved_tensors(checkpoints.latest(), "policies.default.")
    now = weights(trainer)
    for name in now:  # both skipped updates left the weights as step 1 made them
        assert torch.equal(step1[name], now[name])
        assert torch.isfinite(now[name]).all()


def test_malformed_prompt_file_names_the_file_and_line(make_trainer, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a red apple"}\n{"prompt": "a cat", }\n{"prompt": "a dog"}\n')
    with pytest.raises(UserError, match=r"prompts\.jsonl, line 2: invalid JSON"):
        make_trainer(f"data.train={prompts}")


def test_unknown_config_key_in_a_yaml_file_suggests_the_right_one(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  lr: 1.0e-4\n  totl_steps: 10\n")
    with pytest.raises(UserError, match=r"run\.yaml.*train\.totl_steps.*did you mean 'train\.total_steps'"):
        load(config)
