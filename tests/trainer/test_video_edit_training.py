"""Every algorithm on each video and editing family: a reduced training run (tiny model, 2 steps) that updates the
trained weights with finite numbers; and what the runs write for a person to look at (animated validation sheets,
source → result sheets, rollout dumps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diffusion_rl.tracking.video import read_animation

ROOT = Path(__file__).resolve().parents[2]
EDITS = ROOT / "configs/prompts/shapes_edits"

# each algorithm from its quickstart config; windows rescaled to the 4 sampling steps of the fast test config
ALGORITHMS = {
    "flow_grpo": ("quickstart_flow_grpo.yaml", []),
    "flow_grpo_fast": ("quickstart_fast.yaml", ["sampling.window.size=2", "sampling.window.hi=3"]),
    "mixgrpo": ("quickstart_mixgrpo.yaml", ["sampling.window.size=1", "sampling.window.iters_per_window=1"]),
    "dance_grpo": ("quickstart_dance_grpo.yaml", []),
    "grpo_guard": ("quickstart_grpo_guard.yaml", []),
    "flow_dppo": ("quickstart_flow_dppo.yaml", []),
    "dpo": ("quickstart_dpo.yaml", []),
    "nft": ("quickstart_nft.yaml", []),
    "awm": ("quickstart_awm.yaml", ["algorithm.awm.train_timesteps=2"]),
}


@pytest.fixture
def family_run(wan_model_dir, qwen_image_edit_model_dir, flux_kontext_model_dir):
    """name → overrides that train that family's tiny model (videos of 5 frames; edits of the ShapesWorld files)."""
    edit_data = [f"data.train={EDITS / 'train.jsonl'}", f"val.prompts={EDITS / 'val.jsonl'}"]
    return {
        "wan": [f"model.path={wan_model_dir}", "sampling.num_frames=5"],
        "qwen_image_edit": [f"model.path={qwen_image_edit_model_dir}", "model.max_sequence_length=256", *edit_data,
                            "rewards.0.name=shapes_edit"],
        "flux_kontext": [f"model.path={flux_kontext_model_dir}", *edit_data, "rewards.0.name=source_preservation"],
    }  # fmt: skip


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("family", ["wan", "qwen_image_edit", "flux_kontext"])
def test_every_algorithm_trains_each_video_and_editing_family(make_trainer, weights, family_run, family, algorithm):
    config, overrides = ALGORITHMS[algorithm]
    trainer = make_trainer(*family_run[family], *overrides, config=ROOT / "configs" / config)
    assert trainer.engine.model.family == family
    before = weights(trainer)
    rows = trainer.train()
    assert len(rows) == 2 and all(np.isfinite(r["reward/mean"]) for r in rows)
    assert rows[-1]["train/optimizer_steps"] >= 1
    after = weights(trainer)
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert moved and all(torch.isfinite(after[n]).all() for n in after)


def test_a_video_run_writes_animated_validation_sheets_and_rollouts(make_trainer, family_run, tmp_path):
    trainer = make_trainer(*family_run["wan"], "val.before_train=true", "val.every=1", "log.rollout_every=2",
                           "log.tensorboard=true", "train.total_steps=2")  # fmt: skip
    trainer.train()
    run = trainer.run_dir
    sheet = read_animation(run / "samples" / "step_000002.webp")
    assert sheet.shape[0] == 5 and sheet.ndim == 4  # one frame of the sheet per video frame
    assert len({frame.tobytes() for frame in sheet}) > 1  # the frames differ: a video, not a still
    per_sample = sorted((run / "samples" / "step_000002").glob("*.webp"))
    assert per_sample and read_animation(per_sample[0]).shape == (5, 32, 32, 3)
    dump = run / "rollouts" / "step_000002"
    assert (dump / "sheet.webp").is_file() and read_animation(dump / "s000.webp").shape == (5, 32, 32, 3)
    events = list((run / "tensorboard").glob("events.*"))
    assert events and b"val/samples" in events[0].read_bytes()


def test_an_edit_run_shows_source_then_result_and_scores_with_the_sources(make_trainer, family_run):
    trainer = make_trainer(*family_run["qwen_image_edit"], "val.before_train=true", "log.rollout_every=1",
                           "train.total_steps=1")  # fmt: skip
    rows = trainer.train()
    assert 0 <= rows[0]["val/reward/mean"] <= 1  # shapes_edit read each sample's spec from its row
    from PIL import Image

    with Image.open(trainer.run_dir / "rollouts" / "step_000001" / "sheet.png") as sheet:
        width = sheet.width
    # 2 tiles a row (group 2), each source | result: 2 × 32 px + a 2 px bar, upscaled 2× to stay legible (128 px)
    assert width == 2 * (2 * (2 * 32 + 2)) + 2
    # the validation images of the report come with their sources, and the report shows them in their own column
    from diffusion_rl.cli import main
    from diffusion_rl.tracking.val_images import read_validation_images

    rows_at = next(iter(read_validation_images(trainer.run_dir / "samples").values()))
    first = rows_at[0]
    assert first["sources"] == ["p000_c0.png"] and first["source_paths"][0].is_file()
    with Image.open(first["source_paths"][0]) as source:
        expected = trainer.val_records[0].images[0].load(32, 32)
        assert np.array_equal(np.asarray(source.convert("RGB")), expected)
    assert main(["report", str(trainer.run_dir)]) == 0
    page = (trainer.run_dir / "report" / "report.html").read_text()
    assert "<th>source</th>" in page and 'alt="source 0"' in page
