"""Trainers: one loop (base.Trainer) and one subclass per algorithm family; `make_trainer` picks it from the config."""

from __future__ import annotations


def make_trainer(cfg):
    """The trainer of `cfg.algorithm.family` (policy_gradient or direct_preference)."""
    from diffusion_rl.trainer.direct_preference import DirectPreferenceTrainer
    from diffusion_rl.trainer.policy_gradient import PolicyGradientTrainer

    trainers = {"policy_gradient": PolicyGradientTrainer, "direct_preference": DirectPreferenceTrainer}
    return trainers[cfg.algorithm.family](cfg)
