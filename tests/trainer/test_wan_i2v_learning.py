"""Wan image-to-video (the tiny Wan 2.1-style I2V, small preset) learns with Flow-GRPO and with DiffusionNFT to keep
its first frame: the reward is the image-to-video quickstart's frame-0 `source_preservation` against the condition
image (ShapesWorld scenes), the validation reward's gain averaged over run.seed 0, 1, 2.

Measured gains (2026-11-27, AMD EPYC without AMX, load ~3.5; 5 steps of 2 prompts × 4 at lr 1e-2, one micro-batch,
the CLIP tokens through the image cross-attention at the 16 text tokens: families/wan_i2v.py): Flow-GRPO +0.016 /
+0.025 / +0.023, DiffusionNFT +0.023 / +0.022 / +0.004, of a reward near 0.47 (this file and
test_wan_flf2v_learning.py 41 s). Before that routing (the image tokens went through the text cross-attention):
+0.015 / +0.016 / +0.017 and +0.024 / +0.019 / +0.004 (2026-11-26). Each step's 8 samples train in one micro-batch
(ONE_MICRO_BATCH; the same gradient up to float rounding as 2 micro-batches of 4: the same gains to the third digit).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import ONE_MICRO_BATCH

ROOT = Path(__file__).resolve().parents[2]
EDITS = ROOT / "configs/prompts/shapes_edits"
CONFIGS = {"flow_grpo": "quickstart_flow_grpo.yaml", "nft": "quickstart_nft.yaml"}
REDUCED = ("model.family=wan_i2v", "sampling.num_frames=5", "sampling.guidance=4.5", "data.prompts_per_step=2",
           "data.group_size=4", "train.total_steps=5", "train.lr=1e-2", "val.before_train=true", "val.every=1000",
           "val.n=2", f"data.train={EDITS / 'train.jsonl'}", f"val.prompts={EDITS / 'val.jsonl'}",
           "rewards.0.name=source_preservation", "rewards.0.frames=first")  # fmt: skip


@pytest.mark.parametrize("algorithm", sorted(CONFIGS))
def test_wan_i2v_learns_to_keep_its_first_frame_over_three_seeds(make_trainer, wan_i2v_model_dir, tmp_path, algorithm):
    gains = []
    for seed in (0, 1, 2):
        trainer = make_trainer(*REDUCED, ONE_MICRO_BATCH, f"run.seed={seed}", f"run.dir={tmp_path / str(seed)}",
                               f"model.path={wan_i2v_model_dir}",
                               config=ROOT / "configs" / CONFIGS[algorithm])  # fmt: skip
        rows = trainer.train()
        gains.append(rows[-1]["val/reward/mean"] - rows[0]["val/reward/mean"])
    assert sum(gains) / 3 > 0.005, f"{algorithm}: gains {gains}"
