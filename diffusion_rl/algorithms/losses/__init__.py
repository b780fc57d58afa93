"""Policy-gradient losses, one file each; importing this package registers the built-in ones in LOSSES."""

from diffusion_rl.algorithms.base import LOSSES, LossOutput
from diffusion_rl.algorithms.losses import flow_dppo, flow_grpo, grpo_guard, tempflow_grpo  # noqa: F401  (register the losses)
from diffusion_rl.algorithms.losses.base import PolicyLossInput, PolicyLossSettings, kl_to_reference

__all__ = ["LOSSES", "LossOutput", "PolicyLossInput", "PolicyLossSettings", "kl_to_reference"]
