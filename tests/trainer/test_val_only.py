"""run.val_only: validate the resumed checkpoint and exit, leaving the run's metrics and checkpoints alone."""

from __future__ import annotations

import json

import pytest

from diffusion_rl.tracking import read_metrics


def test_val_only_validates_the_resumed_checkpoint_as_training_did(make_trainer):
    trained = make_trainer("train.save_every=1", "val.every=2")
    trained.train()
    run = trained.run_dir
    metrics_before = (run / "metrics.jsonl").read_text()
    last_val = read_metrics(run)[-1]

    rows = make_trainer("run.val_only=true").train()
    assert len(rows) == 1 and rows[0]["step"] == 2
    assert rows[0]["val/reward/mean"] == pytest.approx(last_val["val/reward/mean"], rel=1e-6)
    assert rows[0]["val/reward/best@n"] == pytest.approx(last_val["val/reward/best@n"], rel=1e-6)
    record = json.loads((run / "samples" / "step_000002.json").read_text())
    assert record["checkpoint"] == str((run / "checkpoints" / "step_000002").resolve())
    assert record["val/reward/mean"] == rows[0]["val/reward/mean"]
    assert (run / "metrics.jsonl").read_text() == metrics_before  # nothing logged, nothing trained
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_val_only_without_a_checkpoint_validates_the_initial_model(make_trainer):
    trainer = make_trainer("run.val_only=true")
    rows = trainer.train()
    assert [r["step"] for r in rows] == [0]
    assert (trainer.run_dir / "samples" / "step_000000.png").is_file()
    assert (trainer.run_dir / "samples" / "step_000000.json").is_file()
    assert not (trainer.run_dir / "checkpoints").exists() and not (trainer.run_dir / "metrics.jsonl").exists()


def test_val_only_needs_validation_prompts(make_config):
    with pytest.raises(Exception, match="run.val_only=true .* val.prompts"):
        make_config("run.val_only=true", "val.prompts=null")
