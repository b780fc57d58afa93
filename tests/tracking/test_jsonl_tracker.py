import json
import math

import numpy as np
import pytest
import torch

from diffusion_rl.errors import UserError
from diffusion_rl.tracking import JsonlTracker, read_metrics


def test_rows_are_written_step_first_and_readable_before_close(tmp_path):
    tracker = JsonlTracker(tmp_path)
    tracker.log_metrics({"reward/mean": 0.5, "loss": np.float32(0.25), "kl": torch.tensor(0.125), "n": 3}, step=1)
    tracker.log_metrics({"reward/mean": 0.75}, step=2)
    # flushed per call: another reader sees both rows while the tracker is still open
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert list(json.loads(lines[0])) == ["step", "reward/mean", "loss", "kl", "n"]
    assert read_metrics(tmp_path) == [
        {"step": 1, "reward/mean": 0.5, "loss": 0.25, "kl": 0.125, "n": 3},
        {"step": 2, "reward/mean": 0.75},
    ]
    tracker.close()


def test_non_finite_values_are_written_as_null(tmp_path):
    tracker = JsonlTracker(tmp_path)
    tracker.log_metrics({"a": math.nan, "b": math.inf, "c": 1.0}, step=0)
    tracker.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0, "a": null, "b": null, "c": 1.0}\n'


def test_non_numeric_metric_is_rejected_with_its_name(tmp_path):
    tracker = JsonlTracker(tmp_path)
    with pytest.raises(TypeError, match="'prompt'"):
        tracker.log_metrics({"prompt": "a cat"}, step=0)
    with pytest.raises(ValueError, match="reserved"):
        tracker.log_metrics({"step": 3}, step=0)
    tracker.close()


def test_resume_from_drops_rows_after_the_checkpoint_step(tmp_path):
    tracker = JsonlTracker(tmp_path)
    for step in range(1, 6):
        tracker.log_metrics({"reward/mean": float(step)}, step=step)
    tracker.close()

    resumed = JsonlTracker(tmp_path)
    resumed.resume_from(3)
    resumed.log_metrics({"reward/mean": 40.0}, step=4)
    resumed.close()

    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[-1]["reward/mean"] == 40.0
    assert not [p for p in tmp_path.iterdir() if p.name != "metrics.jsonl"]  # no temp file left behind


def test_partial_last_line_from_a_crash_is_skipped_and_not_appended_to(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 0.5}]

    tracker = JsonlTracker(tmp_path)
    tracker.log_metrics({"loss": 0.25}, step=2)
    tracker.close()
    assert read_metrics(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]


def test_corrupt_middle_line_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2"):
        read_metrics(path)


def test_read_metrics_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no metrics file"):
        read_metrics(tmp_path / "nope.jsonl")
