"""Policy losses, registered by name in LOSSES; importing this package registers the built-in ones."""

from diffusion_rl.algorithms.losses import flow_grpo  # noqa: F401  (registers "flow_grpo")
from diffusion_rl.algorithms.losses.base import LOSSES, LossFn, LossOutput, PolicyLossInput

__all__ = ["LOSSES", "LossFn", "LossOutput", "PolicyLossInput"]
