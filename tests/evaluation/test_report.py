"""`diffusion-rl report RUN_DIR` on a finished short quickstart run."""

from __future__ import annotations

import json
import logging
import re

import pytest

from diffusion_rl.cli import main
from diffusion_rl.tracking import read_metrics


def test_report_writes_plots_and_a_summary_of_a_finished_run(trained_run, capsys):
    run = trained_run("val.every=1", "val.before_train=true").run_dir
    assert main(["report", str(run)]) == 0
    report = run / "report"
    for name in ("reward.png", "validation.png", "policy.png", "algorithm.png", "timing.png"):
        assert (report / name).read_bytes().startswith(b"\x89PNG"), name
    text = (report / "report.md").read_text()

    rows = read_metrics(run)
    val = [(r["step"], r["val/reward/mean"]) for r in rows if "val/reward/mean" in r]
    best_step, best = max(val, key=lambda point: point[1])
    assert f"Step {best_step}: val/reward/mean {best:.6g}" in text
    assert f"checkpoints/step_{best_step:06d}" in text or best_step == 0  # step 0 has no checkpoint
    final_reward = [r["reward/mean"] for r in rows if "reward/mean" in r][-1]
    assert re.search(rf"\| reward/mean +\| \S+ +\| {re.escape(f'{final_reward:.6g}')} ", text)
    total = sum(r["timing/step"] for r in rows if "timing/step" in r)
    assert f"{total:.1f} s over 2 logged steps" in text
    for phase in ("generate", "reward", "update", "validate", "checkpoint"):
        assert re.search(rf"\| {phase} +\| [0-9.]+ +\| [0-9.]+% ", text), phase
    assert "![timing](timing.png)" in text
    # the update metrics left out are named with the one value each had at every step (an on-policy step: KL 0)
    note = re.search(r"Not drawn \(the same at every step\): (.*)\.\n", text)
    assert note, text
    for item in note.group(1).split(", "):
        key, value = item.rsplit(" ", 1)
        assert {r[key] for r in rows if key in r} == {float(value)}, item


def test_report_on_a_directory_without_metrics_is_a_one_line_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diffusion-rl: error: no metrics file at") and len(err.splitlines()) == 1


def test_report_on_damaged_metrics_skips_each_bad_line_and_value_with_a_warning_naming_it(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        b'{"step": 1, "reward/mean": "abc"}\n{"step": "x"}\n\xff not UTF-8\n'
        b'{"step": 2, "reward/mean": 0.5}\n{"step": 3, "reward/mean": 0.75}\n'
    )
    with caplog.at_level(logging.WARNING):
        assert main(["report", str(tmp_path)]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"{path}:2: not a metrics row (a JSON object with an integer 'step'); skipping it and 1 more such line: fix "
        "the line or delete it",
        f"{path}:1: 'reward/mean' is \"abc\", not a number; skipping it",
    ]
    assert re.search(r"\| reward/mean +\| 0\.5 +\| 0\.75 +\|", (tmp_path / "report" / "report.md").read_text())


def test_report_out_option_writes_elsewhere(trained_run, tmp_path):
    run = trained_run().run_dir
    assert main(["report", str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "report.md").is_file() and not (run / "report").exists()


@pytest.mark.parametrize("values, phases", [([1.0, 2.0], {"generate": 0.5, "update": 2.0})])
def test_timing_split_sums_phases_and_keeps_the_rest_as_other(values, phases):
    from diffusion_rl.evaluation.report import timing_split

    rows = [
        {"step": 1, "timing/step": values[0], "timing/generate": 0.25, "timing/update": 0.5},
        {"step": 2, "timing/step": values[1], "timing/generate": 0.25, "timing/update": 1.5},
    ]
    total, split = timing_split(rows)
    assert total == 3.0
    assert split == {**phases, "other": 0.5}


def test_the_algorithm_panel_holds_the_update_size_and_the_loss_s_own_metrics_only():
    from diffusion_rl.evaluation.report import UPDATE_KEYS, algorithm_keys

    rows = [
        {"step": 1, "awm/mse": 1.0, "dppo/kl_max": 0.1, "pairs/count": 4.0, "guard/brightness": 0.5,
         "reward/mean": 0.2, "train/weight_change_rel": 1e-3, "mystery/value": 3.0},
        {"step": 2, "tdm_r1/fake_error": 0.3, "flash/rectify_weight": 1.2},
    ]  # fmt: skip
    # awm and tdm_r1 by their names; flow_dppo's, flash_grpo's and dpo's metrics by the prefixes they register
    expected = ["awm/mse", "dppo/kl_max", "flash/rectify_weight", "pairs/count", "tdm_r1/fake_error"]
    assert algorithm_keys(rows) == [*UPDATE_KEYS, *expected]
    # a loss metric whose series the policy panel draws already (AWM's policy loss is the loss without a KL): once
    rows = [{"step": s, "loss": 0.1 * s, "awm/policy_loss": 0.1 * s, "awm/mse": 1.0 + s} for s in (1, 2)]
    assert algorithm_keys(rows) == [*UPDATE_KEYS, "awm/mse"]
    rows[1]["awm/policy_loss"] = 0.3  # not the same series: drawn
    assert algorithm_keys(rows) == [*UPDATE_KEYS, "awm/mse", "awm/policy_loss"]


def test_a_loss_that_stays_at_zero_is_said_to_be_zero_by_construction(tmp_path):
    from diffusion_rl.evaluation.report import write_report, zero_loss_note

    flat = [{"step": s, "loss": (-1) ** s * 2e-9, "grad_norm": 0.1} for s in (1, 2, 3)]
    assert zero_loss_note(flat).startswith("loss stays within ±2.0e-09 of 0: on-policy the ratio is 1")
    assert zero_loss_note([{"step": 1, "loss": 2e-9}, {"step": 2, "loss": 0.3}]) is None  # it moves: nothing to say
    assert zero_loss_note([{"step": 1, "grad_norm": 0.1}]) is None
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in flat))
    md = write_report(tmp_path).read_text()
    html = (tmp_path / "report" / "report.html").read_text()
    assert "~0 by construction" in md and "~0 by construction" in html
