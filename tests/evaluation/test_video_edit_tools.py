"""The command-line tools on the video and editing families: init-tiny, sample, doctor, eval and report write what a
person looks at (animated WebP for videos, source → result for edits) and score with the condition images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffusion_rl.cli import main
from diffusion_rl.tracking.video import read_animation

ROOT = Path(__file__).resolve().parents[2]
EDITS = ROOT / "configs/prompts/shapes_edits"
SOURCE = EDITS / "images" / "0048.png"


@pytest.mark.parametrize(
    ("family", "preset", "pipeline"),
    [("wan", "ti2v", "WanPipeline"), ("qwen_image_edit", "2511", "QwenImageEditPlusPipeline"),
     ("flux_kontext", "small", "FluxKontextPipeline")],
)  # fmt: skip
def test_init_tiny_writes_the_video_and_edit_families(tmp_path, family, preset, pipeline):
    out = tmp_path / "model"
    assert main(["init-tiny", str(out), "--family", family, "--preset", preset]) == 0
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == pipeline


def test_sample_writes_an_animated_sheet_for_video_and_a_source_result_sheet_for_edits(
    wan_model_dir, flux_kontext_model_dir, tmp_path
):
    common = ["--height", "32", "--width", "32", "--steps", "2", "--device", "cpu", "--n", "2"]
    argv = ["sample", "--model", str(wan_model_dir), "--prompt", "a red ball", "--frames", "5", *common]
    assert main([*argv, "--out", str(tmp_path / "video.png")]) == 0
    assert read_animation(tmp_path / "video.webp").shape[0] == 5  # a video's sheet: .webp whatever --out said
    argv = ["sample", "--model", str(flux_kontext_model_dir), "--prompt", "make the triangle yellow", "--image"]
    assert main([*argv, str(SOURCE), *common, "--guidance", "3.5", "--out", str(tmp_path / "edit.png")]) == 0
    with Image.open(tmp_path / "edit.png") as sheet:
        tile = np.asarray(sheet.convert("RGB"))[: 4 * 32]  # tiles upscaled 2× to 128 px wide: source | bar | result
    source = np.asarray(Image.open(SOURCE).convert("RGB")).repeat(2, axis=0).repeat(2, axis=1)
    assert np.array_equal(tile[:64, :64], source)
    with pytest.raises(SystemExit):
        main(["sample", "--model", str(wan_model_dir), "--prompt", "x", "--frames"])  # argparse: a value is needed
    assert main(["sample", "--model", str(wan_model_dir), "--prompt", "x", "--frames", "4", *common]) == 2


@pytest.mark.parametrize("name", ["wan", "qwen_image_edit"])
def test_doctor_on_video_and_edit_models(wan_model_dir, qwen_image_edit_model_dir, tmp_path, capsys, name):
    model = {"wan": wan_model_dir, "qwen_image_edit": qwen_image_edit_model_dir}[name]
    argv = [
        "doctor",
        "--model",
        str(model),
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--height",
        "32",
        "--width",
        "32",
        "--steps",
        "2",
        "--micro-batch",
        "1",
        "--max-sequence-length",
        "256",
        "--out",
        str(tmp_path / "d.png"),
    ]
    argv += ["--frames", "5"] if name == "wan" else []  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"family     {name}" in text and "total" in text
    if name == "wan":
        assert "32×32×5 frames" in text and read_animation(tmp_path / "d.webp").shape[0] == 5
    else:  # no --image: a generated test picture is the source
        assert "1 condition image(s)" in text and (tmp_path / "d.png").is_file()


def test_eval_of_videos_writes_animated_sheets_and_scores_every_frame(wan_model_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red ball bouncing\nwaves on a beach\n")
    argv = ["eval", "--model", str(wan_model_dir), "--prompts", str(prompts), "--reward",
            "jpeg_compressibility,temporal_consistency", "--n", "2", "--steps", "2", "--height", "32", "--width",
            "32", "--frames", "5", "--device", "cpu", "--max-sequence-length", "16",
            "--out", str(tmp_path / "e")]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "e" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["image"].endswith(".webp") for r in rows)
    assert all(0 < r["scores"]["temporal_consistency"] <= 1 for r in rows)
    assert read_animation(tmp_path / "e" / "base" / "sheet.webp").shape[0] == 5
    metrics = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert metrics["settings"]["frames"] == 5 and metrics["columns"][0]["sheet"] == "base/sheet.webp"


def test_eval_of_edits_gives_the_sources_to_model_and_rewards(qwen_image_edit_model_dir, tmp_path):
    argv = ["eval", "--model", str(qwen_image_edit_model_dir), "--prompts", str(EDITS / "val.jsonl"), "--reward",
            "shapes_edit,source_preservation", "--n", "1", "--steps", "2", "--height", "32", "--width", "32",
            "--device", "cpu", "--max-sequence-length", "256", "--out", str(tmp_path / "e")]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "e" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    assert all(0 <= r["scores"]["source_preservation"] <= 1 and r["scores"]["shapes_edit"] is not None for r in rows)
    with Image.open(tmp_path / "e" / "base" / "sheet.png") as sheet:
        assert sheet.width == 2 * 64 + 4  # one column: each tile source | bar | result, upscaled 2×
