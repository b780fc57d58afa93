"""What a short run leaves in its run directory."""

from __future__ import annotations

import json
import math

from diffusion_rl.tracking import read_metrics

EVERY_STEP_KEYS = (
    "step",
    "reward/mean",
    "loss",
    "clip_fraction",
    "approx_kl",
    "grad_norm",
    "lr",
    "timing/generate",
    "timing/reward",
    "timing/update",
)


def test_short_run_writes_metrics_samples_plot_config_checkpoint_and_tensorboard(make_trainer):
    trainer = make_trainer("val.every=1", "val.before_train=true", "log.tensorboard=true")
    returned = trainer.train()
    run = trainer.run_dir

    rows = read_metrics(run / "metrics.jsonl")
    assert rows == returned
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: validation before training
    assert "val/reward/mean" in rows[0]
    for row in rows[1:]:
        missing = [k for k in EVERY_STEP_KEYS if k not in row]
        assert not missing, f"step {row['step']} lacks {missing}"
        assert all(isinstance(row[k], int | float) for k in EVERY_STEP_KEYS), row
        assert "val/reward/mean" in row
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]

    assert sorted(p.name for p in (run / "samples").iterdir()) == [
        "step_000000",  # one file per validation image, for the HTML report
        "step_000000.png",
        "step_000001",
        "step_000001.png",
        "step_000002",
        "step_000002.png",
    ]
    index = json.loads((run / "samples" / "step_000002" / "index.json").read_text())
    assert [(r["prompt_index"], r["sample"], r["file"]) for r in index[:2]] == [
        (0, 0, "p000_s0.png"),
        (1, 0, "p001_s0.png"),
    ]
    assert all((run / "samples" / "step_000002" / r["file"]).is_file() for r in index)
    assert "guard/brightness" in rows[1] and "timing/guard" in rows[1]
    assert "guard/val_drift" in rows[0] and rows[0]["guard/val_drift"] == 0.0  # step 0 is the reference
    assert (run / "reward.png").stat().st_size > 0
    assert (run / "config.yaml").read_text().startswith("run:")
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"
    checkpoint = run / "checkpoints" / "step_000002"
    assert {"dcp", "state.pt", "config.yaml"} <= {p.name for p in checkpoint.iterdir()}
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)


def test_validate_outside_a_run_returns_metrics_and_writes_the_grid(make_trainer):
    trainer = make_trainer()
    metrics = trainer.validate()  # no trackers yet: the grid still goes to samples/
    assert math.isfinite(metrics["val/reward/mean"]) and math.isfinite(metrics["val/reward/best@n"])
    assert (trainer.run_dir / "samples" / "step_000000.png").is_file()
