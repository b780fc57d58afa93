"""What a run shows of its samples: rollout dumps on disk, and validation/rollout galleries in TensorBoard."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diffusion_rl.rewards import make_reward
from diffusion_rl.tracking import read_metrics


def read_dump(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "rollout.jsonl").read_text().splitlines()]


def test_rollout_dumps_every_n_steps_keep_at_most_max_images(make_trainer):
    # batch of 2 prompts × 2; steps 2 and 4 of 4 dump, 3 images each
    trainer = make_trainer("log.rollout_every=2", "log.rollout_max_images=3", "train.total_steps=4")
    trainer.train()
    rollouts = trainer.run_dir / "rollouts"
    assert sorted(p.name for p in rollouts.iterdir()) == ["step_000002", "step_000004"]
    reward = make_reward("jpeg_compressibility")
    for folder in rollouts.iterdir():
        assert sorted(p.name for p in folder.glob("s[0-9]*.png")) == ["s000.png", "s001.png", "s002.png"]
        assert (folder / "sheet.png").is_file()
        rows = read_dump(folder)
        assert [r["index"] for r in rows] == [0, 1, 2, 3]
        assert [r["image"] for r in rows] == ["s000.png", "s001.png", "s002.png", None]
        step = int(folder.name.removeprefix("step_"))
        assert {r["step"] for r in rows} == {step}
        assert [r["uid"] for r in rows] == [f"s{step - 1}-p0"] * 2 + [f"s{step - 1}-p1"] * 2
        for group in (0, 1):  # group-normalised advantages: one member above the mean, one below
            advantages = [r["advantage"] for r in rows if r["group"] == group]
            assert sum(advantages) == pytest.approx(0.0, abs=1e-6)
        # the stored reward is the reward of the stored image (PNG is lossless)
        images = np.stack([np.asarray(Image.open(folder / r["image"]).convert("RGB")) for r in rows[:3]])
        scores = reward(images, [r["prompt"] for r in rows[:3]], [{}] * 3)
        assert [r["rewards"]["jpeg_compressibility"] for r in rows[:3]] == pytest.approx(scores.tolist(), rel=1e-6)
        assert [r["reward"] for r in rows[:3]] == pytest.approx(scores.tolist(), rel=1e-6)
    timed = [r["step"] for r in read_metrics(trainer.run_dir) if "timing/dump" in r]
    assert timed == [2, 4]


def test_rollout_dump_with_no_images_keeps_the_jsonl(make_trainer):
    trainer = make_trainer("log.rollout_every=1", "log.rollout_max_images=0", "train.total_steps=1")
    trainer.train()
    folder = trainer.run_dir / "rollouts" / "step_000001"
    assert sorted(p.name for p in folder.iterdir()) == ["rollout.jsonl"]
    assert [r["image"] for r in read_dump(folder)] == [None] * 4


def test_rollout_dumps_are_off_by_default(make_trainer):
    trainer = make_trainer()
    trainer.train()
    assert not (trainer.run_dir / "rollouts").exists()


def test_tensorboard_holds_validation_and_rollout_galleries_with_captions(make_trainer):
    trainer = make_trainer(
        "log.tensorboard=true", "val.every=1", "val.before_train=true", "val.n=2", "log.rollout_every=1"
    )
    trainer.train()
    events = EventAccumulator(str(trainer.run_dir / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert {"val/samples", "train/rollout"} <= set(events.Tags()["images"])
    assert [e.step for e in events.Images("val/samples")] == [0, 1, 2]
    assert [e.step for e in events.Images("train/rollout")] == [1, 2]
    png = events.Images("val/samples")[-1].encoded_image_string
    assert png.startswith(b"\x89PNG")
    captions = events.Tensors("val/samples/text_summary")
    assert [c.step for c in captions] == [0, 1, 2]
    text = captions[-1].tensor_proto.string_val[0].decode()
    val_row = [r for r in read_metrics(trainer.run_dir) if r["step"] == 2][0]
    assert text.startswith(f"step 2: validation reward mean {val_row['val/reward/mean']:.4g}")
    for prompt in ("a blue vase with white tulips", "a small boat on a misty river at sunrise"):
        assert f"{prompt}: " in text
