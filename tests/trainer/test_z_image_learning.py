"""The tiny Z-Image trains end to end and learns with Flow-GRPO and with DiffusionNFT: the reduced quickstart
(tests/trainer/conftest.py LEARNS: JPEG compressibility, 4 prompts × 4, 32 px, 4 sampling steps) at 8 training
steps, CFG-free as Z-Image-Turbo samples, run for seeds 0, 1, 2; the mean gain of the fixed-seed validation reward
must be positive by more than the validation noise (the Turbo preset: tests/trainer/test_few_step_presets.py).

Flow-GRPO's plain gains could not fail: with its loss's sign flipped (a one-line edit, reverted) they were still
+2.6e-4 / +1.1e-4 / +1.2e-4 (as written +4.6e-4 / +3.4e-4 / +3.1e-4) — CFG-free, any update makes these images
compress better. Its test therefore trains each seed on the reward and on its negation and asks for the mean of the
two gains (conftest.py `reversal_signals`, the drift cancelled): as written +2.2e-4 / +1.3e-4 / +7.3e-5, sign
flipped −5.2e-5 / −1.9e-4 / −1.4e-4 (2026-11-26, AMD EPYC without AMX). DiffusionNFT's plain gains do separate
(flipped +6.7e-5 / +2.8e-5 / −0.5e-5, mean 3.0e-5 < 5e-5), and its drift-free signal is small at these settings
(−4.8e-5 / +2.7e-5 / +1.4e-4): its test keeps the plain gains.

Measured plain gains (2026-11-26, small preset, lr 1e-2, 8 steps, each step's 16 samples in one micro-batch; 1 byte
of JPEG is 2e-6 of reward, an untrained image ~1.6 kB): DiffusionNFT +1.1e-4 / +8.1e-5 / +4.2e-4 for seeds 0 / 1 / 2;
in micro-batches of 4 (the same gradient up to float rounding, 1.5x the CPU time): +1.4e-4 / +3.2e-4 / +2.9e-4.
"""

from __future__ import annotations

from pathlib import Path
from tempfile import mkdtemp

from .conftest import JPEG_SIZE, ONE_MICRO_BATCH, reversal_signals

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"flow_grpo": ROOT / "configs/quickstart_flow_grpo.yaml", "nft": ROOT / "configs/quickstart_nft.yaml"}


def _train(make_trainer, learns, model_dir, run_dir, algorithm: str, seed: int, *overrides: str) -> list[dict]:
    trainer = make_trainer(*learns, f"model.path={model_dir}", "sampling.guidance=1.0", "train.total_steps=8",
                           ONE_MICRO_BATCH, f"run.seed={seed}", f"run.dir={run_dir}", *overrides,
                           config=CONFIGS[algorithm])  # fmt: skip
    assert trainer.engine.model.family == "z_image"
    rows = trainer.train()
    assert rows[-1]["step"] == 8
    return rows


def test_tiny_z_image_learns_with_flow_grpo_against_the_drift(make_trainer, learns, user_reward, z_image_model_dir,
                                                              tmp_path):  # fmt: skip
    def train(seed: int, reward: str) -> list[dict]:
        return _train(make_trainer, learns, z_image_model_dir, mkdtemp(dir=tmp_path), "flow_grpo", seed,
                      f"rewards.0.name={reward}")  # fmt: skip

    signals = reversal_signals(train, (0, 1, 2), ("jpeg_compressibility", user_reward(JPEG_SIZE)))
    # 25 bytes of JPEG on average, after the drift
    assert sum(signals) / 3 > 5e-5, f"flow_grpo: drift-free gains per seed {signals}"


def test_tiny_z_image_learns_with_nft_over_seeds_0_to_2(make_trainer, learns, z_image_model_dir, tmp_path):
    gains = []
    for seed in (0, 1, 2):
        rows = _train(make_trainer, learns, z_image_model_dir, tmp_path / str(seed), "nft", seed)
        gains.append(rows[-1]["val/reward/mean"] - rows[0]["val/reward/mean"])
    # 25 bytes of JPEG on average (with NFT's sign flipped: +6.7e-5 / +2.8e-5 / −0.5e-5, mean 3.0e-5)
    assert sum(gains) / 3 > 5e-5, f"nft: gains per seed {gains}"
