"""The guard on a quickstart-like tiny run whose reward pays for darkness: it fires, stops, and the report shows it."""

from __future__ import annotations

import json

import pytest

from diffusion_rl.checkpoint.store import CheckpointManager
from diffusion_rl.cli import main
from diffusion_rl.tracking import read_metrics

DARKNESS = """
return (1.0 - images.mean(axis=(1, 2, 3)) / 255.0).astype(np.float32)
"""
# the reduced quickstart that learns (tests/trainer/conftest.py's LEARNS), paid for dark images
HACKS = (
    "sampling.guidance=4.5",
    "data.prompts_per_step=4",
    "data.group_size=4",
    "train.lr=1e-2",
    "train.total_steps=30",
    "train.save_every=2",
    "train.keep_last=0",
    "val.before_train=true",
    "val.every=5",
    "guard.baseline_steps=2",
)


def test_a_hacking_run_is_stopped_by_the_guard_naming_statistic_and_step(make_trainer, user_reward, caplog):
    trainer = make_trainer(f"rewards.0.name={user_reward(DARKNESS)}", *HACKS, "guard.action=rollback")
    rows = trainer.train()

    alerts = [json.loads(x) for x in (trainer.run_dir / "guard" / "alerts.jsonl").read_text().splitlines()]
    first = alerts[0]
    stopped_at = rows[-1]["step"]
    assert stopped_at < 30 and first["step"] == stopped_at  # the run ended at the step of its first alert
    assert first["rule"] == "relative_change" and first["act"]
    # the warning names the statistic, the step, the value (the mean over the last steps covering
    # guard.min_prompts = 16 prompts: 4 steps of 4) and the baseline
    span = first["span"]
    message = (f"guard: {first['stat']} at step {stopped_at} is {first['value']:.4g} (mean of the last {span} steps),"
               f" baseline {first['baseline']:.4g}")  # fmt: skip
    assert span == 4 and any(r.getMessage().startswith(message) for r in caplog.records)
    assert first["value"] == pytest.approx(sum(row[f"guard/{first['stat']}"] for row in rows[-span:]) / span)
    assert rows[-1]["guard/alerts"] >= 1

    # rolled back: the checkpoint before the first policy of the steps that mean covers (the rollout of step t comes
    # from the policy after t − 1 updates) is loaded and is what `latest` points at
    summary = json.loads((trainer.run_dir / "guard" / "summary.json").read_text())
    good = max(s for s, _ in CheckpointManager(trainer.run_dir).list() if s < stopped_at - span)
    assert summary["outcome"] == f"Rolled back at step {stopped_at} ({first['stat']}) to checkpoint step {good}"
    assert CheckpointManager(trainer.run_dir).latest().name == f"step_{good:06d}" and trainer.step == good
    assert read_metrics(trainer.run_dir)[-1]["step"] == stopped_at

    assert main(["report", str(trainer.run_dir)]) == 0
    html = (trainer.run_dir / "report" / "report.html").read_text()
    assert f"first: {first['stat']} at step {stopped_at}" in html and summary["outcome"] in html
    md = (trainer.run_dir / "report" / "report.md").read_text()
    assert "## Guard alerts" in md and f"| {stopped_at}" in md and first["stat"] in md


def test_a_guard_rollback_exits_3_says_so_last_and_is_not_repeated(train_argv, tmp_path, capsys):
    # validation drift past a tiny limit: the validation at step 2 fires, blaming checkpoint 2; 1 is the one before
    argv = train_argv("guard.stats=[val_drift]", "guard.max_val_drift=1e-9", "guard.action=rollback", "train.lr=1e-2",
                      "val.before_train=true", "val.every=2", "train.save_every=1", "train.total_steps=4")  # fmt: skip
    assert main(argv) == 3
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("diffusion-rl: stopped: guard: Rolled back at step 2 (val_drift) to checkpoint step 1")
    assert "resume with a lower train.lr" in last and "another run.seed" in last
    assert CheckpointManager(tmp_path / "run").latest().name == "step_000001"

    assert main(argv) == 2  # the same settings again would take the same steps to the same rollback
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("diffusion-rl: error: the guard ended this run at step 2") and "train.lr" in line
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]  # nothing of the run was touched

    assert main([*argv, "train.lr=5e-3"]) == 3  # a lower lr goes on from checkpoint 1 (and drifts again)
    assert "Rolled back at step 2 (val_drift)" in capsys.readouterr().err.strip().splitlines()[-1]
