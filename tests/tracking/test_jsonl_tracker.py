import json
import logging
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


DAMAGED = (
    b'{"step": 1, "loss": 0.5}\n'
    b"not json\n"
    b'{"step": 2, "loss": 0.4, "reward/mean": "abc", "kl": [1]}\n'
    b"\xff\xfe not UTF-8\n"
    b'{"step": "x"}\n'
    b'{"step": 3, "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    b'{"step": 4, "loss": 0.2}\n'
)


def test_a_damaged_line_or_value_is_skipped_with_one_warning_naming_the_first(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(DAMAGED)
    with caplog.at_level(logging.WARNING, logger="diffusion_rl.tracking.jsonl"):
        rows = read_metrics(path)
    assert rows == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}, {"step": 4, "loss": 0.2}]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}:2: not valid JSON (Expecting value); skipping it and 3 more such lines: fix the line or delete it",
        f"{path}:3: 'reward/mean' is \"abc\", not a number; skipping it and 1 more such value",
    ]


def test_a_resume_keeps_damaged_lines_as_they_are_and_drops_the_rows_after_its_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(DAMAGED)
    resumed = JsonlTracker(tmp_path)
    resumed.resume_from(2)
    resumed.log_metrics({"loss": 0.3}, step=3)
    resumed.close()
    lines = DAMAGED.split(b"\n")
    assert path.read_bytes() == b"\n".join([*lines[:6], b'{"step": 3, "loss": 0.3}', b""])  # step 4 dropped
    assert [row["step"] for row in read_metrics(path)] == [1, 2, 3]


def test_read_metrics_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no metrics file"):
        read_metrics(tmp_path / "nope.jsonl")
