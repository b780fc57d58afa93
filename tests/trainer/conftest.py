"""Helpers for the trainer tests: build a trainer from overrides, read its weights, write user rewards."""

from __future__ import annotations

import textwrap

import pytest
import torch

from diffusion_rl.trainer import make_trainer as trainer_for
from diffusion_rl.trainer.trainer import Trainer

# Quickstart settings (full fine-tuning, CFG 4.5, jpeg_compressibility, eps 1e-8) at reduced size: small preset,
# 32 px, 4 steps, 16 steps of 4 prompts × 4. The higher lr makes up for the fewer steps. Seeds 0-9 all improve
# the fixed-seed validation reward (by 2.8-14 %); the JPEG size of an untrained image is ~1.5 kB.
LEARNS = (
    "rewards.0.name=jpeg_compressibility",
    "sampling.guidance=4.5",
    "data.prompts_per_step=4",
    "data.group_size=4",
    "train.total_steps=16",
    "train.lr=1e-2",
    "val.before_train=true",
    "val.every=1000",  # more than the run's steps: after the last step only
    "val.n=4",
)

# A step's 16 samples (LEARNS: 4 prompts × 4; or fewer) in 1 micro-batch: the gradient of micro-batches of 4 up to float
# rounding, for about half the CPU time a row of the tiny models' forward + backward (measured at 8 vs 32 rows of the
# small SD3 transformer with CFG: 2.1-2.6 vs 1.0-1.1 ms). The rounding moves each seed's run: a learning test that
# takes it lists its seeds' gains measured with it.
ONE_MICRO_BATCH = "train.micro_batch_size=16"


def reversal_signals(train, seeds, rewards: tuple[str, str]) -> list[float]:
    """Each seed's learning signal with the training's common drift cancelled. `train(seed, reward)` runs one reduced
    training and returns its rows; it runs for a reward and for its exact negation (`rewards`: their names). Any
    update, whatever its sign, also changes the tiny random models' images in some common way (they smooth, they
    brighten); that change helps one of the two rewards exactly as much as it hurts the other, so the mean of the two
    runs' gains on their own validation reward keeps only the part that follows the reward, and a sign error in a
    loss makes it negative. For a loss whose targets are odd in the reward (group-normalised advantages, DPO's chosen
    and rejected), the negated reward's run is exactly the run of the loss with its sign flipped."""
    signals = []
    for seed in seeds:
        gains = []
        for reward in rewards:
            rows = train(seed, reward)
            gains.append(rows[-1]["val/reward/mean"] - rows[0]["val/reward/mean"])
        signals.append(sum(gains) / 2)
    return signals


# The negation of jpeg_compressibility (−kB/500) as a user reward: for `reversal_signals`
JPEG_SIZE = """
from diffusion_rl.rewards.jpeg import jpeg_size_kb

return np.array([jpeg_size_kb(image) / 500 for image in images], dtype=np.float32)
"""


@pytest.fixture
def learns() -> tuple[str, ...]:
    """Overrides under which the reduced quickstart reliably learns."""
    return LEARNS


@pytest.fixture
def make_trainer(make_config):
    """make_trainer(*overrides, config=...) → the config's family's trainer on make_config(*overrides, config=...)."""

    def make(*overrides: str, **kwargs) -> Trainer:
        return trainer_for(make_config(*overrides, **kwargs))

    return make


def trained_weights(trainer) -> dict[str, torch.Tensor]:
    """A detached copy of the trained policy's weights (LoRA tensors, or the whole transformer)."""
    return trainer.engine.model.policies.trainable_state_dict()


@pytest.fixture
def weights():
    return trained_weights


@pytest.fixture
def user_reward(tmp_path):
    """user_reward(body) → a `file.py:reward` spec for `def reward(images, prompts, metadata):` + body."""
    count = 0

    def write(body: str) -> str:
        nonlocal count
        count += 1
        path = tmp_path / f"user_reward_{count}.py"
        source = "import numpy as np\n\nCALLS = [0]\n\n\ndef reward(images, prompts, metadata):\n"
        path.write_text(source + textwrap.indent(textwrap.dedent(body), "    "))
        return f"{path}:reward"

    return write
