"""The trainer: one loop and one training step for every algorithm (trainer/trainer.py)."""

from __future__ import annotations


def make_trainer(cfg):
    """The trainer for `cfg` (one for every algorithm: the algorithm's `prepare` is the only difference)."""
    from diffusion_rl.trainer.trainer import Trainer

    return Trainer(cfg)
