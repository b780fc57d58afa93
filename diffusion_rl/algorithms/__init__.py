"""Algorithms: group advantages, rollout correction, and every registered loss with the `Algorithm` that runs it.

Importing this package registers the built-in losses (one file each: losses/ for the policy-gradient ones,
preference/ for Diffusion-DPO, DiffusionNFT and AWM). See algorithms/base.py for what an algorithm supplies.
"""

from diffusion_rl.algorithms import losses, preference  # noqa: F401  (registers the built-in losses)
from diffusion_rl.algorithms.base import (
    LOSSES,
    Algorithm,
    LossOutput,
    LossSettings,
    LossSpec,
    Targets,
    TrainBatch,
    UpdatePosition,
    make_algorithm,
    register_loss,
)

__all__ = [
    "LOSSES",
    "Algorithm",
    "LossOutput",
    "LossSettings",
    "LossSpec",
    "Targets",
    "TrainBatch",
    "UpdatePosition",
    "make_algorithm",
    "register_loss",
]
