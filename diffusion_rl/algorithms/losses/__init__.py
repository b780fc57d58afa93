"""Policy losses, registered by name in LOSSES; importing this package registers the built-in ones."""

from diffusion_rl.algorithms.losses import flow_dppo, flow_grpo, grpo_guard  # noqa: F401  (register the losses)
from diffusion_rl.algorithms.losses.base import LOSSES, LossFn, LossOutput, PolicyLossInput

__all__ = ["LOSSES", "LossFn", "LossOutput", "PolicyLossInput"]
