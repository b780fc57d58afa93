"""Wan 2.2 TI2V-5B (the tiny `ti2v` preset of `wan`: a residual VAE that folds 2×2 pixels first, expanded timesteps)
learns with Flow-GRPO and with DiffusionNFT in both its modes, the validation reward's gain over run.seed 0, 1, 2
(2 prompts × 4 videos of 5 frames at 32×32 a step, CFG 4.5, lr 1e-2):

- text-to-video (its WanPipeline read as `wan`, `model.family: auto`), 12 steps: the video quickstart's reward, the
  JPEG size of every frame (configs/quickstart_video.yaml; one byte is 2e-6, an untrained frame ~1.35 kB);
- image-to-video (`model.family: wan_i2v`), 8 steps, on ShapesWorld first frames: the first latent frame is the
  given frame's, at timestep 0, so the video's frame 0 is the same whatever the weights and frame-0
  `source_preservation` (the Wan 2.1 I2V test's reward, tests/trainer/test_wan_i2v_learning.py) is a constant
  here; the reward is the last frame's `source_preservation` against the first frame: keep the scene.

Measured gains (2026-11-26, AMD EPYC without AMX, load 10–14 from other jobs): text-to-video +1.6e-4 / +5.8e-5 /
+1.6e-4 (+82 / +29 / +78 bytes; 8 steps: +8.3e-5 / +8.7e-6 / +1.1e-4), image-to-video +0.020 / +0.021 / +0.023 of a
reward near 0.56 (frames: mean, frame 0 included: +0.008 / +0.008 / +0.010; frames: first: 0 / 0 / 0). Each case
took 20–24 s at load 9–11 (its pytest process 20–23 s of CPU, setup included). Each step's 8 samples train in one
micro-batch (ONE_MICRO_BATCH; the same gradient up to float rounding as the 2 micro-batches of 4 above, 0.83x the
CPU time): text-to-video +1.6e-4 / +5.2e-5 / +1.7e-4, image-to-video +0.020 / +0.021 / +0.023 (2026-11-26).

DiffusionNFT on the same tasks with its quickstart's settings (ODE rollouts, CFG-free; `quickstart_nft.yaml`, so the
text-to-video case's reward is the quickstart's JPEG size of each frame, its prompts the video ones), one micro-batch:
text-to-video +1.1e-4 / +1.2e-5 / +7.3e-5, image-to-video +0.016 / +0.009 / +0.017; with NFT's sign flipped (r(−A),
reverted) −1.9e-4 / −2.1e-4 / −2.2e-4 and −0.018 / −0.015 / −0.030 (2026-11-26).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import ONE_MICRO_BATCH

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "configs/prompts"
SHAPES = PROMPTS / "shapes_edits"
SHARED = ("sampling.num_frames=5", "sampling.guidance=4.5", "data.prompts_per_step=2", "data.group_size=4",
          "train.lr=1e-2", "val.before_train=true", "val.every=1000")  # fmt: skip
MODES = {  # mode → (config, overrides, the family the checkpoint loads as)
    "text_to_video": ("quickstart_video.yaml", ("train.total_steps=12", "val.n=4",
                                                f"data.train={PROMPTS / 'video.txt'}",
                                                f"val.prompts={PROMPTS / 'video_val.txt'}"), "wan"),
    "image_to_video": ("quickstart_flow_grpo.yaml", ("model.family=wan_i2v", "train.total_steps=8", "val.n=2",
                                           "rewards.0.name=source_preservation", "rewards.0.frames=last",
                                           f"data.train={SHAPES / 'train.jsonl'}",
                                           f"val.prompts={SHAPES / 'val.jsonl'}"), "wan_i2v"),
}  # fmt: skip


# DiffusionNFT: its quickstart's settings (ODE rollouts, CFG-free) on the same task
ALGORITHMS = {"flow_grpo": (None, ()), "nft": ("quickstart_nft.yaml", ("sampling.guidance=1",))}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_ti2v_learns_over_three_seeds(make_trainer, wan_ti2v_model_dir, tmp_path, mode, algorithm):
    config, overrides, family = MODES[mode]
    algorithm_config, algorithm_overrides = ALGORITHMS[algorithm]
    gains = []
    for seed in (0, 1, 2):
        trainer = make_trainer(*SHARED, *overrides, *algorithm_overrides, ONE_MICRO_BATCH, f"run.seed={seed}",
                               f"run.dir={tmp_path / str(seed)}", f"model.path={wan_ti2v_model_dir}",
                               config=ROOT / "configs" / (algorithm_config or config))  # fmt: skip
        assert trainer.engine.model.family == family and trainer.cfg.algorithm.loss == algorithm
        rows = trainer.train()
        gains.append(rows[-1]["val/reward/mean"] - rows[0]["val/reward/mean"])
    if mode == "text_to_video":  # 10 bytes of JPEG on average; the measured means are 64 and 32 bytes
        assert sum(gains) / 3 > 2e-5, f"{mode}, {algorithm}: gains {gains}"
    else:  # every seed keeps more of the scene: the measured gains are 0.009-0.023
        assert min(gains) > 0.005, f"{mode}, {algorithm}: gains {gains}"
