"""Algorithms: credit (group advantages, tree credit), rollout correction, and every registered loss with the
`Algorithm` that runs it.

The built-in losses are one file each (losses/ for the policy-gradient ones, preference/ for Diffusion-DPO,
DiffusionNFT and AWM), registered into LOSSES (config/plugins.py) when it is first looked up. See algorithms/base.py
for what an algorithm supplies.
"""

from diffusion_rl.algorithms.base import (
    Algorithm,
    LossOutput,
    LossSettings,
    LossSpec,
    TrainBatch,
    UpdatePosition,
    make_algorithm,
    register_loss,
)
from diffusion_rl.algorithms.credit import Targets

__all__ = [
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
