"""Wan 2.2 A14B (the tiny `a14b` preset of `wan`: two experts switched at timestep 875, flow_shift 12) learns, both
experts trained as one network: the validation reward's gain over run.seed 0, 1, 2 (the video quickstart's JPEG
size of every frame; 2 prompts × 4 videos of 5 frames at 32×32 a step, CFG 4.5, lr 1e-2), with

- Flow-GRPO, whose calls at one step share a timestep: a call runs one expert (10 steps on UniPC's flow σ points,
  t = 1000, 991, 980, 966, 947, 923, 889 on the high-noise expert, 838, 751, 574 on the low-noise one);
- DiffusionNFT, which draws a time per sample: a call's rows go to both experts, each on its own.

Measured gains (2026-11-26, AMD EPYC without AMX, load 5–6 from other jobs; one byte of JPEG is 2e-6): Flow-GRPO
+1.05e-4 / +1.57e-4 / +8.0e-5, DiffusionNFT +1.64e-4 / +5.1e-5 / +1.14e-4; 21–22 s a case.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.models.tiny import save_tiny

ROOT = Path(__file__).resolve().parents[2]
SHARED = ("sampling.num_frames=5", "sampling.guidance=4.5", "data.prompts_per_step=2", "data.group_size=4",
          "train.lr=1e-2", "val.before_train=true", "val.every=1000", "val.n=4")  # fmt: skip
LOSSES = {"flow_grpo": ("quickstart_video.yaml", "train.total_steps=12"),
          "nft": ("quickstart_video.yaml", "train.total_steps=12", "algorithm.loss=nft")}  # fmt: skip


@pytest.fixture(scope="module")
def a14b_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_wan_a14b"), "wan", "a14b", seed=0)


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a14b_learns_with_both_experts_over_three_seeds(make_trainer, a14b_dir, tmp_path, loss):
    config, *overrides = LOSSES[loss]
    gains = []
    for seed in (0, 1, 2):
        trainer = make_trainer(*SHARED, *overrides, f"run.seed={seed}", f"run.dir={tmp_path / str(seed)}",
                               f"model.path={a14b_dir}", config=ROOT / "configs" / config)  # fmt: skip
        rows = trainer.train()
        gains.append(rows[-1]["val/reward/mean"] - rows[0]["val/reward/mean"])
    assert sum(gains) / 3 > 2e-5, f"{loss}: gains {gains}"
