"""docs/gpu.md's and benchmarks/RESULTS.md's throughput tables are what scripts/throughput_table.py computes from the
GPU check's record; its formula on numbers worked by hand; verl-omni's rows as published add up."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("throughput_table", ROOT / "scripts" / "throughput_table.py")
throughput_table = sys.modules["throughput_table"] = importlib.util.module_from_spec(_spec)  # for its dataclass
_spec.loader.exec_module(throughput_table)
RECORD = json.loads(throughput_table.RECORD.read_text(encoding="utf-8"))


def test_both_tables_are_what_the_record_gives():
    assert throughput_table.drifted(RECORD) == [], "run `python scripts/throughput_table.py --write`"


def test_a_row_scales_the_micro_batch_seconds_per_image_to_the_configs_batch():
    # 8 images in 12 s of rollout and 8 s of update: 2.5 s each; a config of 512 images on 4 GPUs: 128 per GPU
    result = {"rollout_s": 12.0, "update_s": 8.0, "images_per_step": 8, "flops_per_step": 2e15}
    figures = throughput_table.throughput(result, 512, 4, peak_tflops=1000.0)
    # MFU: 2e15 FLOPs / 20 s / 1e15 FLOP/s
    assert figures == pytest.approx({"images_per_gpu": 128, "seconds_per_image": 2.5, "seconds_per_step": 320.0,
                                     "images_per_gpu_s": 0.4, "mfu": 0.1})  # fmt: skip


def test_the_qwen_image_row_is_the_configs_shape_and_the_measured_seconds():
    rows, figures = throughput_table.rows(RECORD)
    part = RECORD["merged"]["parts"]["qwen_image_lora"]["result"]
    assert throughput_table.config_shape(part["config"], part["overrides"]) == (512, 4)  # verl-omni's 32 × 16 on 4
    per_image = (part["rollout_s"] + part["update_s"]) / part["images_per_step"]
    assert figures["qwen_image_lora"]["seconds_per_step"] == pytest.approx(128 * per_image)
    assert len(rows) == len(throughput_table.MODEL_PARTS)  # every model part of the record has its row


def test_the_wan22_rows_scale_runs_10_and_11_to_their_configs_128_videos_on_8_gpus():
    _, figures = throughput_table.rows(RECORD)
    # run 10, TI2V-5B: 4.665 s rollout + 16.569 s update for 2 videos; run 11, A14B: 3.822 + 17.095 s for 2
    # (rounded to the ms, hence the tolerance); 128 videos on 8 GPUs = 16 per GPU
    assert figures["wan22_ti2v_lora"]["seconds_per_step"] == pytest.approx(16 * (4.665 + 16.569) / 2, abs=0.02)
    assert figures["wan22_a14b_lora"]["seconds_per_step"] == pytest.approx(16 * (3.822 + 17.095) / 2, abs=0.02)
    assert figures["wan22_a14b_lora"]["images_per_gpu_s"] == pytest.approx(2 / (3.822 + 17.095), rel=1e-3)


def test_a_stale_table_is_named(tmp_path):
    doc = tmp_path / "gpu.md"
    shutil.copy(ROOT / "docs/gpu.md", doc)
    doc.write_text(doc.read_text(encoding="utf-8").replace("| 0.305 |", "| 0.350 |"), encoding="utf-8")
    assert throughput_table.drifted(RECORD, docs=(doc,)) == [doc]


@pytest.mark.parametrize("row", throughput_table.VERL_OMNI, ids=lambda p: p.recipe[:30])
def test_verl_omnis_published_rows_add_up(row):
    gpus = int(row.gpus.split("×")[0])
    computed = row.images_per_step / (gpus * row.seconds_per_step)
    if row.note:  # the one row whose images per step do not give its throughput: the note says which would
        assert computed != pytest.approx(row.images_per_gpu_s, rel=0.03)
        assert 384 / (gpus * row.seconds_per_step) == pytest.approx(row.images_per_gpu_s, rel=0.03)
    else:  # the async row counts its reward's 5th GPU too
        assert computed == pytest.approx(row.images_per_gpu_s, rel=0.03)
