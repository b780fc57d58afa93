"""benchmarks/diagnosis.py: per-step training metrics of each algorithm on the ranking's task, and their thirds."""

import argparse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def diagnosis(load_benchmark):
    return load_benchmark("diagnosis")


def test_thirds_average_each_third_and_leave_a_missing_metric_out(diagnosis):
    rows = [{"grad_norm": float(i), "clip_fraction": 0.0} for i in range(6)]
    rows[5].pop("clip_fraction")
    assert diagnosis.thirds(rows, "grad_norm") == [0.5, 2.5, 4.5]
    assert diagnosis.thirds(rows, "clip_fraction") == [0.0, 0.0, None]
    assert "–" in diagnosis.table({"x": rows})[4]  # clip frac's last third


def test_a_run_keeps_every_steps_update_metrics(diagnosis, load_benchmark, shapes_model, tmp_path):
    info = load_benchmark("learning").ensure_base_model(shapes_model)
    args = argparse.Namespace(seed=0, threads=2, steps=2, set=["sampling.num_steps=3", "data.group_size=2",
                                                                "data.prompts_per_step=2"])  # fmt: skip
    rows = diagnosis.run("flow_grpo", ROOT / "configs/quickstart_flow_grpo.yaml", args, shapes_model, info, tmp_path)
    assert len(rows) == 2
    for row in rows:
        assert {"reward/mean", "grad_norm", "train/weight_change_rel", "clip_fraction", "approx_kl"} <= row.keys()
        assert row["train/weight_change_rel"] > 0
