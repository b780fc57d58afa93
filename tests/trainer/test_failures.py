"""What goes wrong during training: failing rewards, non-finite updates, bad prompt files and config keys."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_rl.checkpoint.state import read_saved_tensors
from diffusion_rl.checkpoint.store import CheckpointManager
from diffusion_rl.config import load
from diffusion_rl.errors import TrainingDiverged, UserError
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
    _nan_loss(trainer.engine)
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


def _nan_rows(monkeypatch, rows_of_step) -> None:
    """Rollouts whose rows rows_of_step(step) come out with NaN latents (and so black images), as a diverged
    policy's do."""
    import diffusion_rl.engine.worker as worker_module

    real = worker_module.training_rollout
    calls = [0]

    def rollout(*args, **kwargs):
        traj = real(*args, **kwargs)
        rows = rows_of_step(calls[0])
        calls[0] += 1
        for latents in (traj.final_latents, traj.latents, traj.log_probs, traj.means):  # all of it, as diverged
            latents[rows] = float("nan")
        traj.images[rows] = 0
        return traj

    monkeypatch.setattr(worker_module, "training_rollout", rollout)


def test_samples_with_non_finite_latents_are_failed_unscored(make_trainer, user_reward, monkeypatch):
    spec = user_reward(
        """
        assert not (images.reshape(len(images), -1) == 0).all(axis=1).any(), "a black image was scored"
        CALLS[0] += len(images)
        return images.reshape(len(images), -1).mean(axis=1).astype(np.float32) / 255
        """
    )
    _nan_rows(monkeypatch, lambda step: [1] if step == 0 else [])  # step 1: sample 1 of 4 (the first group's)
    trainer = make_trainer(f"rewards.0.name={spec}", "train.total_steps=2")
    calls = _record_targets(trainer)
    rows = trainer.train()

    (first, second) = rows
    assert first["sampling/nonfinite_fraction"] == 0.25 and first["reward/failed_fraction"] == 0.25
    assert second["sampling/nonfinite_fraction"] == 0.0 and second["reward/failed_fraction"] == 0.0
    rewards, targets = calls[0]
    assert torch.isnan(rewards).tolist() == [False, True, False, False]
    assert targets.advantages[1] == 0 and targets.advantages[0] == 0  # a group of one scored sample: advantage 0
    assert torch.all(targets.advantages[2:] != 0)
    # the NaN row poisons the loss of step 1: that update is skipped, step 2's is taken
    assert first["train/skipped_updates"] == 1 and second["train/optimizer_steps"] == 1


def test_a_step_whose_every_sample_is_non_finite_stops_the_run_naming_the_last_healthy_checkpoint(
    make_trainer, monkeypatch
):
    _nan_rows(monkeypatch, lambda step: slice(None) if step >= 2 else [])
    trainer = make_trainer("train.total_steps=4", "train.save_every=1")
    with pytest.raises(TrainingDiverged, match=r"step 3: the latents of every sample came out NaN/inf") as stop:
        trainer.train()
    assert [r["step"] for r in read_metrics(trainer.run_dir)] == [1, 2]
    # step 3 was sampled by step 2's weights: step_000002 is set aside, `latest` goes back to step_000001
    checkpoints = CheckpointManager(trainer.run_dir)
    assert [step for step, _ in checkpoints.list()] == [1] and checkpoints.latest().name == "step_000001"
    assert str(stop.value).endswith(
        f"latest checkpoint (the last healthy one): {checkpoints.latest()} (the weights that sampled it are set "
        f"aside as {checkpoints.dir / 'broken-step_000002'})"
    )


def test_a_diverging_learning_rate_stops_with_latest_on_a_finite_checkpoint(train_argv, tmp_path, capsys):
    from diffusion_rl.cli import main

    argv = train_argv("train.lr=1e6", "train.total_steps=8", "train.save_every=1", "train.max_consecutive_skips=2")
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffusion-rl: stopped: ") and "latest checkpoint" in err[0]
    checkpoints = CheckpointManager(tmp_path / "run")
    assert f"the last healthy one): {checkpoints.latest() or 'none'}" in err[0]
    for _, path in checkpoints.list():  # what is left to resume from is finite
        saved = read_saved_tensors(path, "policies.default.")
        assert saved and all(torch.isfinite(t).all() for t in saved.values())
    rows = read_metrics(tmp_path / "run")
    assert len(rows) < 8  # it stopped
    # no sample with NaN latents was ever scored as a real one
    assert all(r["reward/failed_fraction"] >= r["sampling/nonfinite_fraction"] for r in rows)


def test_a_reward_breaking_its_output_contract_stops_the_run_in_one_line(train_argv, user_reward, tmp_path, capsys):
    from diffusion_rl.cli import main

    spec = user_reward("return np.zeros(1, dtype=np.float32)  # one score for the whole batch")
    assert main(train_argv(f"rewards.0.name={spec}", "train.total_steps=1")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # no traceback
    assert err[0].startswith(f"diffusion-rl: stopped: reward '{spec}' returned shape (1,) for a batch of 4")
    assert err[0].endswith("latest checkpoint (the last healthy one): none")
