import logging

import numpy as np
import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.tracking import ConsoleTracker, JsonlTracker, MultiTracker, TensorBoardTracker, make_trackers


class _Recorder:
    def __init__(self, fail_on_close=False):
        self.calls = []
        self.fail_on_close = fail_on_close

    def log_metrics(self, metrics, step):
        self.calls.append(("metrics", dict(metrics), step))

    def log_images(self, tag, image, step, caption=""):
        self.calls.append(("images", tag, step, caption))

    def resume_from(self, step):
        self.calls.append(("resume", step))

    def close(self):
        self.calls.append(("close",))
        if self.fail_on_close:
            raise RuntimeError("close failed")


def test_console_logs_a_compact_line_every_n_steps(caplog):
    tracker = ConsoleTracker(every=2)
    metrics = {"reward/mean": 0.61234, "loss": 0.0123, "kl": 0.0004, "timing/step": 3.214, "images/s": 9.94, "x": 1}
    with caplog.at_level(logging.INFO, logger="diffusion_rl.tracking.console"):
        tracker.log_metrics(metrics, step=3)
        tracker.log_metrics(metrics, step=4)
        tracker.log_metrics({"unrelated": 1.0}, step=6)
    assert [r.getMessage() for r in caplog.records] == [
        "step 4 | reward 0.6123 | loss 0.0123 | kl 0.0004 | s/step 3.21 | img/s 9.9"
    ]


def test_console_every_must_be_positive():
    with pytest.raises(ValueError, match="every"):
        ConsoleTracker(every=0)


def test_multi_tracker_fans_out_and_forwards_resume():
    first, second = _Recorder(), _Recorder()
    multi = MultiTracker([first, second])
    image = np.zeros((4, 4, 3), dtype=np.uint8)
    multi.resume_from(7)
    multi.log_metrics({"loss": 1.0}, step=8)
    multi.log_images("samples", image, step=8, caption="c")
    multi.close()
    expected = [("resume", 7), ("metrics", {"loss": 1.0}, 8), ("images", "samples", 8, "c"), ("close",)]
    assert first.calls == expected
    assert second.calls == expected


def test_multi_tracker_closes_all_even_if_one_raises():
    failing, healthy = _Recorder(fail_on_close=True), _Recorder()
    multi = MultiTracker([failing, healthy])
    with pytest.raises(RuntimeError, match="close failed"):
        multi.close()
    assert healthy.calls == [("close",)]


def test_make_trackers_builds_the_requested_trackers(tmp_path):
    trackers = make_trackers(tmp_path, console_every=5)
    assert [type(t) for t in trackers.trackers] == [JsonlTracker, TensorBoardTracker, ConsoleTracker]
    trackers.log_metrics({"reward/mean": 1.0}, step=5)
    trackers.close()
    assert (tmp_path / "metrics.jsonl").is_file()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

    only_jsonl = make_trackers(tmp_path / "b", tensorboard=False, console_every=0)
    assert [type(t) for t in only_jsonl.trackers] == [JsonlTracker]
    only_jsonl.close()
    with pytest.raises(UserError, match="console_every"):
        make_trackers(tmp_path / "c", console_every=-1)
