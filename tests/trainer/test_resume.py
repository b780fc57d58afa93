"""Resume: a run stopped at a checkpoint and continued by a new trainer equals a run that never stopped."""

from __future__ import annotations

import logging

import pytest
import torch

from diffusion_rl.checkpoint.paths import step_of
from diffusion_rl.checkpoint.state import read_saved_tensors
from diffusion_rl.checkpoint.store import CheckpointManager
from diffusion_rl.errors import UserError
from diffusion_rl.tracking.jsonl import read_metrics

# a random SDE window, EMA validation, LR warm-up, checkpoints and validation every 2 steps: all saved state matters
RESUMABLE = (
    "train.save_every=2",
    "val.every=2",
    "val.n=1",
    "sampling.window.kind=random",
    "sampling.window.size=2",
    "train.ema.enabled=true",
    "train.warmup_steps=3",
)


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/")) and k != "images_per_second"}


def _assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, state in a["state"].items():
        assert state.keys() == b["state"][index].keys()
        for name, value in state.items():
            assert torch.equal(value, b["state"][index][name]), f"optimizer state {index}.{name} differs"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resumed_run_equals_a_straight_run(make_trainer, tmp_path, weights, lora):
    options = (*RESUMABLE, f"model.lora.enabled={str(lora).lower()}")
    straight = make_trainer(*options, f"run.dir={tmp_path / 'straight'}", "train.total_steps=4")
    straight_rows = straight.train()

    resumed_dir = f"run.dir={tmp_path / 'resumed'}"
    make_trainer(*options, resumed_dir, "train.total_steps=2").train()
    resumed = make_trainer(*options, resumed_dir, "train.total_steps=4", "run.resume=auto")
    ran = []
    train_step = resumed.train_step
    resumed.train_step = lambda step: ran.append(step) or train_step(step)
    resumed_rows = resumed.train()

    assert ran == [2, 3]  # it continued from the checkpoint of step 2 (a fresh start would also match the numbers)
    assert resumed.step == straight.step == 4
    assert [r["step"] for r in straight_rows] == [r["step"] for r in resumed_rows] == [1, 2, 3, 4]
    assert [_comparable(r) for r in resumed_rows] == [_comparable(r) for r in straight_rows]
    assert "val/reward/mean" in straight_rows[1] and "val/reward/mean" in straight_rows[3]

    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    worker_a, worker_b = straight.engine, resumed.engine
    opt_a, opt_b = worker_a.optimizer, worker_b.optimizer
    _assert_same_optimizer_state(opt_a.optimizer.state_dict(), opt_b.optimizer.state_dict())
    assert opt_a.scheduler.state_dict() == opt_b.scheduler.state_dict()
    assert all(torch.equal(x, y) for x, y in zip(opt_a.ema.shadow, opt_b.ema.shadow))


def test_resume_from_a_missing_path_is_a_user_error(make_trainer, tmp_path):
    missing = tmp_path / "no_such_run" / "checkpoints" / "step_000002"
    with pytest.raises(UserError, match="no_such_run"):
        make_trainer(f"run.resume={missing}").train()


def test_resume_never_moves_the_earlier_run_aside_and_starts_fresh(make_trainer, weights, caplog):
    make_trainer("train.save_every=1", "train.keep_last=0").train()
    run_dir = make_trainer().run_dir
    (run_dir / "notes.txt").write_text("mine")  # a file of the user's in the run directory
    checkpoints = CheckpointManager(run_dir)
    assert [step for step, _ in checkpoints.list()] == [1, 2]
    after_one_step = read_saved_tensors(checkpoints.dir / "step_000001", "policies.default.")

    with caplog.at_level(logging.WARNING):
        fresh = make_trainer("train.total_steps=1", "run.resume=never")
    (aside,) = run_dir.parent.glob("run.before-*")
    said = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
    assert said == [f"run.resume=never: the earlier run in {run_dir} is moved aside to {aside} (delete it when no "
                    "longer needed)"]  # fmt: skip
    assert [step for step, _ in CheckpointManager(aside).list()] == [1, 2] and (aside / "notes.txt").is_file()
    rows = fresh.train()
    assert fresh.step == 1
    assert [r["step"] for r in rows] == [1]  # the old run's rows are not in this run's metrics
    now = weights(fresh)
    assert all(torch.equal(after_one_step[k], now[k]) for k in now)  # one step from the base weights
    assert [step for step, _ in checkpoints.list()] == [1]  # the old run's step 2 is not beside it (sample picks it)
    assert checkpoints.latest().name == "step_000001"


def test_a_diverged_run_resumed_at_a_lower_lr_finishes_at_that_lr(train_argv, tmp_path, capsys, caplog):
    import yaml

    from diffusion_rl.cli import main

    def said() -> list[str]:  # what the resumes logged about their optimizer settings
        return [r.getMessage() for r in caplog.records if "optimizer settings" in r.getMessage()]

    argv = train_argv("train.save_every=1", "train.max_consecutive_skips=2")
    caplog.set_level(logging.INFO, logger="diffusion_rl")
    assert main([*argv, "train.lr=1e-3", "train.total_steps=2"]) == 0  # a healthy start
    argv.append("train.total_steps=6")
    assert main([*argv, "train.lr=1e6"]) == 1  # goes on at an lr that diverges: stopped, latest is healthy
    assert "latest checkpoint" in capsys.readouterr().err
    assert said() == ["resumed with this config's optimizer settings, not the checkpoint's: lr 0.001 → 1000000.0"]
    resumed_at = step_of(CheckpointManager(tmp_path / "run").latest())

    caplog.clear()
    assert main([*argv, "train.lr=1e-4"]) == 0  # "lower train.lr and resume", as the stop message says
    assert said() == ["resumed with this config's optimizer settings, not the checkpoint's: lr 0.001 → 0.0001"]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["lr"] == pytest.approx(1e-4, rel=1e-12) for r in rows[resumed_at:])  # the lr actually used
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["lr"] == 1e-4


def test_a_resume_that_cannot_load_the_checkpoint_names_the_settings_changed_since(train_argv, tmp_path, capsys):
    from diffusion_rl.cli import main

    argv = train_argv("train.save_every=1")  # full fine-tuning
    assert main([*argv, "train.total_steps=1"]) == 0
    capsys.readouterr()
    assert main([*argv, "train.total_steps=2", "model.lora.enabled=true", "train.lr=1e-4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    # only what decides the checkpoint's contents is named: not the longer run, not the rate
    assert err[0].startswith(
        f"diffusion-rl: error: checkpoint {checkpoint} was saved with another config: this one differs in "
        "model.lora.enabled (false → true); resume with its settings, or start over with run.resume=never (loading "
        f"it: checkpoint {checkpoint} is damaged or not ours: Missing key"
    )
