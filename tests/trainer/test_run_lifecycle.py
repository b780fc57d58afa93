"""A run's life: the model it creates, when it validates, and what a kill at the worst moment leaves behind."""

from __future__ import annotations

import hashlib
import json

import pytest

from diffusion_rl.checkpoint.store import CheckpointManager
from diffusion_rl.errors import UserError
from diffusion_rl.models.loader import detect_family
from diffusion_rl.tracking import read_metrics


@pytest.mark.parametrize("family", ["flux", "qwen_image"])
def test_create_tiny_if_missing_makes_the_requested_family(make_config, tmp_path, family):
    from diffusion_rl.trainer.trainer import ensure_model

    path = tmp_path / f"tiny_{family}"
    ensure_model(make_config(f"model.path={path}", f"model.family={family}", "model.create_tiny_if_missing=small"))
    assert detect_family(path) == family


def test_val_every_0_never_validates_and_before_train_still_asks_for_step_0(make_trainer, tmp_path):
    never = make_trainer("val.every=0", "val.before_train=false", f"run.dir={tmp_path / 'never'}")
    rows = never.train()
    assert not any(k.startswith("val/") for r in rows for k in r)
    assert not (never.run_dir / "samples").exists()

    asked = make_trainer("val.every=0", "val.before_train=true", f"run.dir={tmp_path / 'asked'}")
    rows = asked.train()
    assert [r["step"] for r in rows if "val/reward/mean" in r] == [0]
    assert sorted(p.name for p in (asked.run_dir / "samples").iterdir()) == ["step_000000", "step_000000.png"]


def test_a_kill_right_after_the_last_checkpoint_leaves_every_row_and_file_of_a_straight_run(make_trainer, tmp_path):
    options = ("train.total_steps=2", "train.save_every=1", "val.every=2", "val.before_train=true")
    straight = make_trainer(*options, f"run.dir={tmp_path / 'straight'}")
    straight_rows = straight.train()

    killed = make_trainer(*options, f"run.dir={tmp_path / 'killed'}")
    save = killed.checkpoints.save

    def save_then_die(step, write):
        path = save(step, write)
        if step == 2:
            raise SystemExit("killed after publishing the last checkpoint")
        return path

    killed.checkpoints.save = save_then_die
    with pytest.raises(SystemExit):
        killed.train()
    rerun = make_trainer(*options, f"run.dir={tmp_path / 'killed'}")  # run.resume=auto: from step 2, nothing left
    rows = rerun.train()

    assert CheckpointManager(rerun.run_dir).latest().name == "step_000002"
    assert [r["step"] for r in rows] == [r["step"] for r in straight_rows] == [0, 1, 2]
    assert [sorted(r) for r in rows] == [sorted(r) for r in straight_rows]  # the same metrics, the validation's too
    for name in ("step_000000.png", "step_000002.png"):
        assert (rerun.run_dir / "samples" / name).is_file()
    assert read_metrics(rerun.run_dir)[-1]["val/reward/mean"] == pytest.approx(straight_rows[-1]["val/reward/mean"])


def test_the_checkpoint_time_is_logged_with_the_next_step(make_trainer):
    trainer = make_trainer("train.total_steps=3", "train.save_every=1")
    trainer.train()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert ["timing/checkpoint" in r for r in rows] == [False, True, True]


def test_rerunning_a_folder_left_without_a_checkpoint_logs_each_step_once(make_trainer, tmp_path):
    overrides = ("val.before_train=true", "train.total_steps=2", "train.save_every=0", "log.tensorboard=true")
    crashing = make_trainer(*overrides)
    real_step = crashing.train_step

    def crash_at_the_second_step(step):
        if step == 1:
            raise RuntimeError("killed")
        return real_step(step)

    crashing.train_step = crash_at_the_second_step
    with pytest.raises(RuntimeError, match="killed"):
        crashing.train()
    run = tmp_path / "run"
    assert CheckpointManager(run).latest() is None
    assert [r["step"] for r in read_metrics(run)] == [0, 1]  # validation before training, then step 1

    make_trainer(*overrides).train()  # starts over: the earlier rows are its own again, not kept beside them
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]


def tree_digest(folder) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def test_resuming_an_earlier_checkpoint_on_purpose_keeps_the_later_one(make_trainer, tmp_path):
    """run.resume at step 1 of a run that reached step 2: the resumed run's step-2 save replaces nothing of the first
    run; its step_000002 is kept, unchanged, beside the run directory."""
    options = ("train.total_steps=2", "train.save_every=1", "val.every=0", "val.before_train=false")
    first = make_trainer(*options, f"run.dir={tmp_path / 'run'}")
    first.train()
    before = tree_digest(first.checkpoints.dir / "step_000002")
    again = make_trainer(*options, f"run.dir={tmp_path / 'run'}", f"run.resume={first.checkpoints.dir / 'step_000001'}")
    again.train()
    (aside,) = tmp_path.glob("run.after-step_000001-*")
    assert tree_digest(aside / "checkpoints" / "step_000002") == before
    assert [r["step"] for r in read_metrics(aside)] == [1, 2]
    assert CheckpointManager(tmp_path / "run").latest().name == "step_000002"


def test_a_missing_resume_path_is_one_line_before_the_model_loads(make_trainer, tmp_path, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine (and the model) was built before run.resume was checked")

    monkeypatch.setattr("diffusion_rl.trainer.trainer.make_engine", no_engine)
    with pytest.raises(UserError, match=r"run\.resume .*nevr: no such directory"):
        make_trainer(f"run.resume={tmp_path / 'nevr'}")


def test_a_video_reward_on_an_image_run_is_one_line_before_the_model_loads(make_trainer, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine (and the model) was built before the rewards were checked")

    monkeypatch.setattr("diffusion_rl.trainer.trainer.make_engine", no_engine)
    with pytest.raises(UserError, match=r"rewards: 'temporal_consistency' scores videos of at least 2 frames, but this "
                       r"run samples images \(sampling\.num_frames=1\)"):  # fmt: skip
        make_trainer("rewards.0.name=temporal_consistency")
