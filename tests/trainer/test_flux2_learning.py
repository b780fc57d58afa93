"""FLUX.2-klein (the tiny step-distilled model, CFG-free) and FLUX.2-dev learn with Flow-GRPO and with DiffusionNFT:
the reduced quickstart's settings (tests/trainer/conftest.py LEARNS: JPEG size, 4 prompts × 4, lr 1e-2, 32 px) on
FLUX.2's schedule for 10 steps, the validation reward's gain averaged over run.seed 0, 1, 2.

Measured gains (2026-11-26, AMD EPYC without AMX, load ~9; one byte of JPEG is 2e-6): Flow-GRPO +1.6e-5 / +1.2e-5 /
+2.5e-4 (29 s for the three runs), DiffusionNFT +7.6e-6 / +1.1e-4 / −7.6e-6 (39 s). FLUX.2-dev (`small_dev`, load
~11): Flow-GRPO at guidance 4 +6.9e-5 / +6.6e-5 / +4.0e-5. DiffusionNFT at guidance 4 (load ~7.7, 31 s): +1.6e-4 /
+7.6e-5 / +2.7e-4 training the velocity at the sampled guidance; −5.6e-6 / −3.6e-5 / +1.4e-6 when it trained the
guidance-1 velocity, another function than the one sampled on a guidance-embedded model.

Those were trained in micro-batches of 4; the test trains each step's 16 samples in one micro-batch (the same
gradient up to float rounding; all four cases 64.0 -> 43.4 CPU s). Re-measured so (2026-11-26, the same CPU, seeds
0 / 1 / 2): klein Flow-GRPO +2.0e-5 / +3.8e-5 / +3.2e-4, klein DiffusionNFT −5.3e-6 / +1.0e-4 / +3.0e-6, dev
Flow-GRPO +9.9e-5 / +7.1e-5 / +2.4e-5, dev DiffusionNFT +1.5e-4 / +3.9e-6 / +9.5e-5: means 3.4e-5 (klein NFT, 3.8e-5
in micro-batches of 4) to 1.3e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.models.tiny import save_tiny

from .conftest import ONE_MICRO_BATCH

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"flow_grpo": "quickstart_flow_grpo.yaml", "nft": "quickstart_nft.yaml"}


@pytest.fixture(scope="module")
def flux2_dev_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_flux2_dev"), "flux2", "small_dev", seed=0)


@pytest.mark.parametrize("algorithm", sorted(CONFIGS))
@pytest.mark.parametrize("model", ["klein", "dev"])
def test_flux2_learns_on_average_over_three_seeds(make_trainer, learns, request, tmp_path, algorithm, model):
    # klein: CFG-free (guidance 1). dev: both sample and train its guidance embedding at Flux2Pipeline's default 4
    # (DiffusionNFT's conditional velocity is the sampled one there: FlowModel.conditional_guidance)
    model_dir = {"klein": "flux2_model_dir", "dev": "flux2_dev_dir"}[model]
    guidance = 4 if model == "dev" else 1
    gains = []
    for seed in (0, 1, 2):
        trainer = make_trainer(*learns, f"run.seed={seed}", f"run.dir={tmp_path / str(seed)}",
                               f"model.path={request.getfixturevalue(model_dir)}", f"sampling.guidance={guidance}",
                               "train.total_steps=10", ONE_MICRO_BATCH,
                               config=ROOT / "configs" / CONFIGS[algorithm])  # fmt: skip
        rows = trainer.train()
        gains.append(rows[-1]["val/reward/mean"] - rows[0]["val/reward/mean"])
    # one byte of JPEG is 2e-6 of reward: ask for more than a few bytes of the ~1.5 kB on average
    assert sum(gains) / 3 > 1e-5, f"{model} {algorithm}: gains {gains}"
