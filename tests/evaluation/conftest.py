"""A short training run with a checkpoint after every step, for evaluating checkpoints."""

from __future__ import annotations

import pytest

from diffusion_rl.trainer.trainer import Trainer


@pytest.fixture
def trained_run(make_config):
    """trained_run(*overrides) → the finished Trainer (2 steps, checkpoints step_000001 and 2)."""

    def run(*overrides: str) -> Trainer:
        trainer = Trainer(make_config("train.save_every=1", "train.keep_last=0", *overrides))
        trainer.train()
        return trainer

    return run
