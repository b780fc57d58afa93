"""FLUX.2-klein (the tiny step-distilled model, CFG-free) learns with Flow-GRPO and with DiffusionNFT: the reduced
quickstart's settings (tests/trainer/conftest.py LEARNS: JPEG size, 4 prompts × 4, lr 1e-2, 32 px) on klein's
schedule for 10 steps, the validation reward's gain averaged over run.seed 0, 1, 2.

Measured gains (2026-11-26, AMD EPYC without AMX, load ~9; one byte of JPEG is 2e-6): Flow-GRPO +1.6e-5 / +1.2e-5 /
+2.5e-4 (29 s for the three runs), DiffusionNFT +7.6e-6 / +1.1e-4 / −7.6e-6 (39 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"flow_grpo": "quickstart.yaml", "nft": "quickstart_nft.yaml"}


@pytest.mark.parametrize("algorithm", sorted(CONFIGS))
def test_klein_learns_on_average_over_three_seeds(make_trainer, learns, flux2_model_dir, tmp_path, algorithm):
    gains = []
    for seed in (0, 1, 2):
        trainer = make_trainer(*learns, f"run.seed={seed}", f"run.dir={tmp_path / str(seed)}",
                               f"model.path={flux2_model_dir}", "sampling.guidance=1",
                               "train.total_steps=10", config=ROOT / "configs" / CONFIGS[algorithm])  # fmt: skip
        rows = trainer.train()
        gains.append(rows[-1]["val/reward/mean"] - rows[0]["val/reward/mean"])
    # one byte of JPEG is 2e-6 of reward: ask for more than a few bytes of the ~1.5 kB on average
    assert sum(gains) / 3 > 1e-5, f"{algorithm}: gains {gains}"
