"""The guard's detector and runner: baseline, thresholds, patience, alerts, stop and rollback."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from diffusion_rl.config.guard import GuardConfig
from diffusion_rl.errors import UserError
from diffusion_rl.guard import Detector, RunGuard


def _feed(detector, series, stat="brightness", start=1):
    alerts = []
    for step, value in enumerate(series, start=start):
        alerts += detector.update(step, {stat: value})
    return alerts


def test_baseline_is_the_mean_of_the_first_steps_and_the_relative_rule_fires_past_it():
    detector = Detector(GuardConfig(min_prompts=1, baseline_steps=3, max_relative_change=0.5))
    assert _feed(detector, [0.40, 0.44, 0.42]) == []  # the baseline steps are never out of range
    assert detector.baseline("brightness") == pytest.approx(0.42)
    # allowed: 0.5 · 0.42 + 0.02 (noise floor) = 0.23 -> in range down to 0.19
    assert _feed(detector, [0.20], start=4) == []
    (alert,) = _feed(detector, [0.18], start=5)
    assert (alert.step, alert.stat, alert.rule) == (5, "brightness", "relative_change")
    assert alert.baseline == pytest.approx(0.42) and alert.threshold == pytest.approx(0.23)
    assert "brightness at step 5 is 0.18, baseline 0.42" in alert.message and "-57%" in alert.message


def test_steps_of_few_prompts_are_compared_as_means_over_min_prompts():
    # 2 prompts a step, min_prompts 4: the baseline and the current value are means over 2 steps each
    config = GuardConfig(baseline_steps=1, min_prompts=4, max_relative_change=0.5)
    detector = Detector(config)
    for step, value in enumerate([0.2, 0.6], start=1):  # a dark prompt pair, then a bright one
        assert detector.update(step, {"brightness": value}, prompts=2) == []
    assert detector.baseline_span("brightness") == 2 and detector.baseline("brightness") == pytest.approx(0.4)
    # allowed 0.5 · 0.4 + 0.02 = 0.22: a lone step of 0.15 (0.25 below) would be out; the mean of 0.6 and 0.15 is not
    assert detector.update(3, {"brightness": 0.15}, prompts=2) == []
    (alert,) = detector.update(4, {"brightness": 0.1}, prompts=2)  # mean of 0.15 and 0.1: 0.125, 0.275 below
    assert alert.value == pytest.approx(0.125) and alert.span == 2 and alert.threshold == pytest.approx(0.22)
    assert "brightness at step 4 is 0.125 (mean of the last 2 steps), baseline 0.4 (mean of the first 2 steps)" in (
        alert.message
    )
    single = Detector(GuardConfig(baseline_steps=2, min_prompts=1, max_relative_change=0.5))
    for step, value in enumerate([0.2, 0.6], start=1):
        single.update(step, {"brightness": value}, prompts=2)
    assert len(single.update(3, {"brightness": 0.15}, prompts=2)) == 1  # the same step, judged alone


def test_prompts_weight_the_means_and_an_old_history_loads_as_one_prompt_per_step():
    detector = Detector(GuardConfig(baseline_steps=1, min_prompts=4))
    detector.update(1, {"brightness": 0.1}, prompts=1)
    detector.update(2, {"brightness": 0.5}, prompts=3)
    assert detector.baseline("brightness") == pytest.approx((0.1 * 1 + 0.5 * 3) / 4)
    old = Detector(GuardConfig(baseline_steps=2, min_prompts=1))
    old.load_state_dict({"history": {"brightness": [(1, 0.3), (2, 0.5)]}, "streak": {}})
    assert old.history["brightness"] == [(1, 0.3, 1), (2, 0.5, 1)] and old.baseline("brightness") == pytest.approx(0.4)


def test_per_statistic_relative_change_and_noise_floor():
    detector = Detector(GuardConfig(min_prompts=1, baseline_steps=1, relative_change={"dark_fraction": 1.0}))
    # baseline 0.001: 100 % of it is nothing, the 0.02 floor decides -> up to 0.022 allowed
    assert _feed(detector, [0.001, 0.02], stat="dark_fraction") == []
    assert len(_feed(detector, [0.03], stat="dark_fraction", start=3)) == 1


def test_zscore_rule_over_the_window():
    detector = Detector(GuardConfig(min_prompts=1, max_relative_change=None, max_zscore=3.0, window=4))
    # previous window 1, 3, 1, 3: mean 2, std 1 -> allowed 3·1 + 2 (colorfulness floor) = 5
    assert _feed(detector, [1, 3, 1, 3, 6.9], stat="colorfulness") == []
    (alert,) = _feed(detector, [12.0], stat="colorfulness", start=6)  # window 3, 1, 3, 6.9: mean 3.475
    assert alert.rule == "zscore" and alert.baseline == pytest.approx(3.475)


def test_val_drift_has_a_cap_only():
    detector = Detector(GuardConfig(min_prompts=1, max_val_drift=0.2))
    assert _feed(detector, [0.0, 0.1, 0.19], stat="val_drift") == []
    (alert,) = _feed(detector, [0.25], stat="val_drift", start=4)
    assert alert.rule == "max" and alert.threshold == 0.2


def test_patience_counts_consecutive_checks():
    detector = Detector(GuardConfig(min_prompts=1, baseline_steps=1, patience=2))
    alerts = _feed(detector, [0.5, 0.1, 0.5, 0.1, 0.1])
    assert [(a.step, a.act) for a in alerts] == [(2, False), (4, False), (5, True)]


class FakeCheckpoints:
    def __init__(self, steps):
        self.steps, self.latest = steps, None

    def list(self):
        return [(s, Path(f"step_{s:06d}")) for s in self.steps]

    def point_latest_at(self, path):
        self.latest = path


def _dark_images(value, n=4):
    return np.full((n, 8, 8, 3), value, dtype=np.uint8)


@pytest.mark.parametrize("action", ["warn", "stop", "rollback"])
def test_runner_acts_after_the_alert_and_writes_files(tmp_path, action, caplog):
    guard = RunGuard(GuardConfig(min_prompts=1, action=action, baseline_steps=2, stats=["brightness"]), tmp_path)
    checkpoints, loaded = FakeCheckpoints([2, 4, 6]), []
    with caplog.at_level(logging.WARNING):
        for step, value in enumerate([128, 128, 120, 125, 128, 30, 20], start=1):
            metrics = guard.on_rollout(step, _dark_images(value), [0, 0, 1, 1])
            stopped = guard.should_stop(step, checkpoints, loaded.append)
            if stopped:
                break
    assert metrics["guard/brightness"] == pytest.approx(value / 255) and metrics["guard/alerts"] == 1.0
    assert any("brightness at step 6 is 0.1176" in r.getMessage() for r in caplog.records)
    rows = [json.loads(line) for line in (tmp_path / "guard/alerts.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "guard/summary.json").read_text())
    assert summary["stats"]["brightness"]["baseline"] == pytest.approx(128 / 255)
    if action == "warn":
        assert [r["step"] for r in rows] == [6, 7] and not loaded and summary["outcome"] is None
        return
    assert step == 6 and [r["step"] for r in rows] == [6]
    if action == "stop":
        assert summary["outcome"] == "Stopped at step 6 (brightness)" and not loaded
    else:
        # step 6's rollout came from the policy after 5 updates: checkpoint 4 is the newest before it
        assert loaded == [Path("step_000004")] and checkpoints.latest == Path("step_000004")
        assert summary["outcome"] == "Rolled back at step 6 (brightness) to checkpoint step 4"


def test_a_statistic_out_of_range_is_warned_once_then_reminded_and_summed_up(tmp_path, caplog):
    guard = RunGuard(GuardConfig(min_prompts=1, baseline_steps=2, stats=["brightness"], remind_every=10), tmp_path)
    # in range at 1–3, out at 4–40, back at 41–43, out again at 44–45
    series = [128] * 3 + [20] * 37 + [128] * 3 + [20] * 2
    with caplog.at_level(logging.INFO, logger="diffusion_rl.guard.runner"):
        for step, value in enumerate(series, start=1):
            metrics = guard.on_rollout(step, _dark_images(value), [0, 0, 1, 1])
        guard.log_summary()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["WARNING"] * 4 + ["INFO", "WARNING", "WARNING"], lines
    assert lines[0][1].startswith("guard: brightness at step 4 is 0.07843") and "warned once" in lines[0][1]
    assert [m.split(" (")[0] for _, m in lines[1:4]] == [
        f"guard: brightness still out of range at step {s}" for s in (14, 24, 34)
    ]
    assert "(since step 4, 11 alerts in all)" in lines[1][1]
    assert lines[4][1] == "guard: brightness is back in range at step 41 (out since step 4)"
    assert lines[5][1].startswith("guard: brightness at step 44 is")
    assert lines[6][1].startswith("guard: 39 alerts in this run: brightness 39 (first at step 4); see ")
    assert metrics["guard/alerts_total"] == 39.0  # what the console line shows
    rows = (tmp_path / "guard/alerts.jsonl").read_text().splitlines()
    assert len(rows) == 39  # every alert is still written
    with open(tmp_path / "guard/alerts.jsonl", "ab") as file:  # a line damaged, or edited by hand: kept, not counted
        file.write(b'{"step": 7, "st\xff\n')
    resumed = RunGuard(GuardConfig(min_prompts=1, baseline_steps=2, stats=["brightness"], remind_every=10), tmp_path)
    with caplog.at_level(logging.WARNING):
        resumed.load_state_dict(guard.state_dict(), 42)  # the count goes on from the alerts up to the resumed step
        assert resumed.on_rollout(43, _dark_images(20), [0, 0, 1, 1])["guard/alerts_total"] == 38.0
    assert "alerts.jsonl:40: not a JSON object with step, stat; skipped" in caplog.text
    assert (tmp_path / "guard/alerts.jsonl").read_text(errors="replace").count("\n") == 38 + 1


def test_a_rollback_blames_the_first_step_of_the_mean_that_left_its_range(tmp_path):
    config = GuardConfig(action="rollback", baseline_steps=1, min_prompts=4, stats=["brightness"])
    guard = RunGuard(config, tmp_path)
    checkpoints, loaded = FakeCheckpoints([2, 4, 6, 8]), []
    # 2 prompts a step: baseline steps 1–2; step 8's mean of steps 7 and 8 is the first out of range, so the
    # policy that sampled step 7 (after 6 updates) is the first to blame: checkpoint 4 is the newest before it
    for step, value in enumerate([128, 128, 128, 128, 128, 128, 60, 20], start=1):
        guard.on_rollout(step, _dark_images(value), [0, 0, 1, 1])
        if guard.should_stop(step, checkpoints, loaded.append):
            break
    assert step == 8 and loaded == [Path("step_000004")]


def test_rollback_without_an_older_checkpoint_stops(tmp_path):
    guard = RunGuard(GuardConfig(min_prompts=1, action="rollback", baseline_steps=1, stats=["brightness"]), tmp_path)
    guard.on_rollout(1, _dark_images(128), [0, 0, 0, 0])
    guard.on_rollout(2, _dark_images(10), [0, 0, 0, 0])
    loaded = []
    assert guard.should_stop(2, FakeCheckpoints([2]), loaded.append) and not loaded
    assert "no in-range checkpoint" in guard.outcome


def test_validation_drift_is_measured_from_the_first_validation(tmp_path):
    guard = RunGuard(GuardConfig(min_prompts=1, max_val_drift=0.1), tmp_path)
    assert guard.on_validation(0, _dark_images(100))["guard/val_drift"] == 0.0
    metrics = guard.on_validation(5, _dark_images(151))
    assert metrics["guard/val_drift"] == pytest.approx(0.2) and metrics["guard/val_alerts"] == 1.0


def test_state_round_trip_keeps_baseline_and_reference(tmp_path):
    guard = RunGuard(GuardConfig(min_prompts=1, baseline_steps=1), tmp_path)
    guard.on_rollout(1, _dark_images(128), [0, 0, 1, 1])
    guard.on_validation(1, _dark_images(50))
    resumed = RunGuard(GuardConfig(min_prompts=1, baseline_steps=1), tmp_path)
    resumed.load_state_dict(guard.state_dict(), 1)
    assert resumed.detector.baseline("brightness") == pytest.approx(128 / 255)
    assert resumed.on_validation(2, _dark_images(50))["guard/val_drift"] == 0.0


def test_disabled_guard_measures_nothing(tmp_path):
    guard = RunGuard(GuardConfig(enabled=False), tmp_path)
    assert guard.on_rollout(1, _dark_images(1), [0, 0, 0, 0]) == {} and guard.on_validation(0, _dark_images(1)) == {}
    assert not (tmp_path / "guard").exists()


def test_config_rejects_unknown_statistics():
    with pytest.raises(ValueError, match="unknown statistics \\['brightnes'\\]"):
        GuardConfig(stats=["brightnes"])


def test_a_reference_taken_after_the_checkpoint_is_found_on_disk(tmp_path):
    guard = RunGuard(GuardConfig(), tmp_path)
    state = guard.state_dict()  # the checkpoint of step 2 is written first...
    guard.on_validation(2, _dark_images(50))  # ...then step 2's validation takes the reference
    resumed = RunGuard(GuardConfig(), tmp_path)
    resumed.load_state_dict(state, 2)
    assert resumed.reference_step == 2 and resumed.on_validation(4, _dark_images(50))["guard/val_drift"] == 0.0
    stale = RunGuard(GuardConfig(), tmp_path)
    stale.load_state_dict(state, 1)  # a reference from after the checkpoint's step is not this run's past
    assert stale.reference_val is None


def test_a_run_the_guard_stopped_is_not_run_again_with_the_same_settings(tmp_path):
    guard = RunGuard(
        GuardConfig(min_prompts=1, action="stop", baseline_steps=1, stats=["brightness"]), tmp_path, repeat="k1"
    )
    guard.on_rollout(1, _dark_images(128), [0, 0, 0, 0])
    guard.on_rollout(2, _dark_images(10), [0, 0, 0, 0])
    assert guard.should_stop(2, FakeCheckpoints([]), [].append)
    assert guard.ending().startswith("guard: Stopped at step 2 (brightness) (guard/summary.json); to go on")
    with pytest.raises(UserError, match=r"the guard ended this run at step 2 \(Stopped at step 2 \(brightness\)\)"):
        RunGuard(GuardConfig(action="stop"), tmp_path, repeat="k1")
    again = RunGuard(GuardConfig(action="stop"), tmp_path, repeat="k2")  # other settings: it goes on
    assert again.ended["step"] == 2 and again.ending() is None
    assert RunGuard(GuardConfig(), tmp_path).ended is not None  # no key (validation only): no check
