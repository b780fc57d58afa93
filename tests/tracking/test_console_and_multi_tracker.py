import logging

import numpy as np
import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.tracking import ConsoleTracker, JsonlTracker, MultiTracker, TensorBoardTracker, make_trackers
from diffusion_rl.tracking.console import run_summary


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


def test_console_logs_the_first_step_every_n_steps_and_the_last_with_an_eta(caplog, monkeypatch):
    clock = iter([0.0, 103.0, 103.0, 106.0])  # made; step 3's end (twice); step 4's end
    monkeypatch.setattr("diffusion_rl.tracking.console.time.perf_counter", lambda: next(clock))
    tracker = ConsoleTracker(every=4, total_steps=6)
    metrics = {"reward/mean": 0.61234, "loss": 1e-9, "clip_fraction": 0.0, "kl_ref": 0.0, "timing/step": 3.0, "x": 1}
    with caplog.at_level(logging.INFO, logger="diffusion_rl.tracking.console"):
        tracker.log_metrics({"val/reward/mean": 0.5}, step=0)  # validation before training: no line
        tracker.log_metrics(metrics, step=3)  # a resumed run's first step: a line
        tracker.log_metrics(metrics, step=4)  # every 4
        tracker.log_metrics({**metrics, "clip_fraction": 0.25}, step=5)  # neither
        tracker.log_metrics({**metrics, "val/reward/mean": 0.7}, step=6)  # the last
    # the clock starts 3 s (the first step's timing/step) before it ended at 103 s: 3 s per step since then
    assert [r.getMessage() for r in caplog.records] == [
        "step 3/6 | reward 0.61234 | s/step 3.00 | eta 0m09s",  # 3 steps to go
        "step 4/6 | reward 0.61234 | s/step 3.00 | eta 0m06s",  # (106 − 100) s / 2 steps, 2 to go
        "step 6/6 | reward 0.61234 | val_reward 0.7 | s/step 3.00",
    ]


def test_console_shows_clip_fraction_and_kl_only_when_they_are_not_zero(caplog):
    tracker = ConsoleTracker(every=1, total_steps=1)
    with caplog.at_level(logging.INFO, logger="diffusion_rl.tracking.console"):
        tracker.log_metrics({"reward/mean": 1.0, "clip_fraction": 0.125, "kl_ref": 0.002}, step=1)
    assert caplog.records[-1].getMessage() == "step 1/1 | reward 1 | clipped 12.50% | kl_ref 0.002"


def test_console_counts_the_guard_alerts_when_there_are_any(caplog):
    tracker = ConsoleTracker(every=1, total_steps=3)
    with caplog.at_level(logging.INFO, logger="diffusion_rl.tracking.console"):
        tracker.log_metrics({"reward/mean": 1.0, "guard/alerts": 0.0, "guard/alerts_total": 0.0}, step=3)
        tracker.log_metrics({"reward/mean": 1.0, "guard/alerts": 1.0, "guard/alerts_total": 17.0}, step=3)
    assert [r.getMessage() for r in caplog.records] == ["step 3/3 | reward 1", "step 3/3 | reward 1 | guard_alerts 17"]


def test_console_shows_the_given_rewards_in_place_of_the_total(caplog):
    tracker = ConsoleTracker(every=1, total_steps=1, rewards=[("reward/jpeg/mean", "jpeg")])
    with caplog.at_level(logging.INFO, logger="diffusion_rl.tracking.console"):
        tracker.log_metrics({"reward/mean": 0.5, "reward/jpeg/mean": -0.0072, "timing/step": 1.0}, step=1)
    assert caplog.records[-1].getMessage() == "step 1/1 | jpeg -0.0072 | s/step 1.00"


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


def test_a_log_without_a_bar_hears_from_the_run_at_steps_2_4_8_before_the_first_periodic_line(caplog, monkeypatch):
    clock = iter(float(t) for t in range(0, 100))  # made at 0; each logged step's end a second later
    monkeypatch.setattr("diffusion_rl.tracking.console.time.perf_counter", lambda: next(clock))
    quiet, early = ConsoleTracker(every=20, total_steps=40), ConsoleTracker(every=20, total_steps=40, early=True)
    logged = {}
    for name, tracker in (("quiet", quiet), ("early", early)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="diffusion_rl.tracking.console"):
            for step in range(1, 41):
                tracker.log_metrics({"timing/step": 1.0}, step=step)
        logged[name] = [int(r.getMessage().split()[1].split("/")[0]) for r in caplog.records]
    assert logged["quiet"] == [1, 20, 40]
    assert logged["early"] == [1, 2, 4, 8, 16, 20, 40]  # powers of two below the first periodic line, then as before
    assert "eta" in caplog.records[1].getMessage()  # progress with the time left from the first lines on


def test_the_trainer_draws_a_bar_only_on_a_terminal_and_the_console_lines_take_its_place_in_a_log(monkeypatch):
    from diffusion_rl.tracking.console import bar_shown

    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert not bar_shown(True)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert bar_shown(True) and not bar_shown(False)


def test_run_summary_gives_each_end_of_the_training_reward_with_its_standard_error():
    # 20 steps: a tenth is 2 steps. First two 0.2 and 0.4: mean 0.3, sd √0.02 = 0.1414, error 0.1414/√2 = 0.1.
    # Last two 0.5 and 0.5: mean 0.5, error 0. Validation at steps 0 and 20 only; a row without a reward is skipped.
    rewards = [0.2, 0.4] + [0.3] * 16 + [0.5, 0.5]
    rows = [{"step": 0, "val/reward/mean": 0.41}] + [{"step": i + 1, "reward/mean": r} for i, r in enumerate(rewards)]
    rows[-1]["val/reward/mean"] = 0.4567891
    assert run_summary(rows) == [
        "reward/mean: first 2 step(s) 0.3 ± 0.1, last 2 0.5 ± 0",
        "val/reward/mean: before 0.41, after 0.45679",
    ]


def test_run_summary_of_a_short_run_has_no_error_and_no_validation_line():
    assert run_summary([{"step": 1, "reward/mean": 0.25}, {"step": 2, "reward/mean": None}]) == [
        "reward/mean: first 1 step(s) 0.25, last 1 0.25"
    ]
    assert run_summary([]) == []
