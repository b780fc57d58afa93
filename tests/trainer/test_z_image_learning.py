"""The tiny Z-Image trains end to end and learns with Flow-GRPO and with DiffusionNFT: the reduced quickstart
(tests/trainer/conftest.py LEARNS: JPEG compressibility, 4 prompts × 4, 32 px, 4 sampling steps) at 8 training
steps, CFG-free as Z-Image-Turbo samples, run for seeds 0, 1, 2; the mean gain of the fixed-seed validation reward
must be positive by more than the validation noise (the Turbo preset: tests/trainer/test_few_step_presets.py).

Measured gains (2026-11-26, AMD EPYC without AMX, small preset, lr 1e-2, 8 steps, each step's 16 samples in one
micro-batch; 1 byte of JPEG is 2e-6 of reward, an untrained image ~1.6 kB): Flow-GRPO +4.6e-4 / +3.4e-4 / +3.1e-4,
DiffusionNFT +1.1e-4 / +8.1e-5 / +4.2e-4 for seeds 0 / 1 / 2. In micro-batches of 4 (the same gradient up to float
rounding, 1.5x the CPU time of the whole test: 55 vs 36 s): Flow-GRPO +6.0e-4 / +4.0e-4 / +3.9e-4, NFT +1.4e-4 /
+3.2e-4 / +2.9e-4; with 16 steps: Flow-GRPO +5.2e-4 / +4.7e-4 / +1.8e-5, NFT +5.1e-5 / +5.2e-4 / +2.7e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import ONE_MICRO_BATCH

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"flow_grpo": ROOT / "configs/quickstart.yaml", "nft": ROOT / "configs/quickstart_nft.yaml"}


@pytest.mark.parametrize("algorithm", ["flow_grpo", "nft"])
def test_tiny_z_image_learns_over_seeds_0_to_2(make_trainer, learns, z_image_model_dir, tmp_path, algorithm):
    gains = []
    for seed in (0, 1, 2):
        trainer = make_trainer(*learns, f"model.path={z_image_model_dir}", "sampling.guidance=1.0",
                               "train.total_steps=8", ONE_MICRO_BATCH, f"run.seed={seed}",
                               f"run.dir={tmp_path / str(seed)}", config=CONFIGS[algorithm])  # fmt: skip
        assert trainer.engine.model.family == "z_image"
        rows = trainer.train()
        assert rows[-1]["step"] == 8
        gains.append(rows[-1]["val/reward/mean"] - rows[0]["val/reward/mean"])
    # 25 bytes of JPEG on average; the measured means are 3.7e-4 (Flow-GRPO) and 2.0e-4 (NFT)
    assert sum(gains) / 3 > 5e-5, f"{algorithm} gains per seed {gains}"
