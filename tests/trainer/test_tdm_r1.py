"""TDM-R1 (algorithm.loss: tdm_r1) on the tiny model: it follows the reward on seeds 0-2, and refuses a rollout it
cannot train on.

Learning: the `learns` overrides (jpeg_compressibility, 16 steps of 4 prompts × 4, lr 1e-2, 32 px) on
configs/quickstart_tdm_r1.yaml (4 CFG-free steps, so the `learns` guidance 4.5 is set back to 1). A run rewarding
JPEG size (the negated reward) is trained too and the mean of the two runs' gains taken (conftest.py
`reversal_signals`: the tiny model's common drift cancelled). Measured (2026-11-28), seeds 0/1/2: +12.3/+4.9/+6.3e-5
of reward; with the surrogate's ascent direction flipped −10.0/−4.6/−7.2e-5; at push 0.05, kl_beta 1 (a KL-bound
shift 20× smaller) +0.03e-5 on seed 0, and at push 1, kl_beta 0.1 +1.6/+3.1/+0.2e-5.
"""

from __future__ import annotations

from pathlib import Path
from tempfile import mkdtemp

import pytest

from diffusion_rl.config import load
from diffusion_rl.errors import UserError

from .conftest import JPEG_SIZE, ONE_MICRO_BATCH, reversal_signals

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/quickstart_tdm_r1.yaml"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tdm_r1_follows_the_reward_against_the_drift(make_trainer, learns, user_reward, tmp_path, seed):
    """TDM-R1 raises JPEG compressibility, and JPEG size when rewarded for it: the mean of the two runs' gains (the
    drift cancelled) is positive on every seed."""

    def train(seed: int, reward: str) -> list[dict]:
        overrides = ("sampling.guidance=1", ONE_MICRO_BATCH, f"rewards.0.name={reward}")
        run_dir = f"run.dir={mkdtemp(dir=tmp_path)}"
        return make_trainer(*learns, f"run.seed={seed}", *overrides, run_dir, config=CONFIG).train()

    (signal,) = reversal_signals(train, (seed,), ("jpeg_compressibility", user_reward(JPEG_SIZE)))
    print(f"tdm_r1 seed {seed}: drift-free gain {signal:.3g}")
    # one byte of JPEG is 2e-6 of reward: ask for more than a few bytes after the drift
    assert signal > 1e-5, f"tdm_r1 seed {seed}: drift-free gain {signal:.3g}"


@pytest.mark.parametrize("overrides", [["sampling.sde_type=ode"], ["sampling.noise_level=0.7"]])
def test_a_rollout_that_is_not_deterministic_and_recorded_is_refused(overrides):
    with pytest.raises(UserError, match=r"tdm_r1 trains on the states of a deterministic rollout, recorded step by"):
        load(CONFIG, overrides)
