"""Flow-GRPO: PPO-clip on the per-step likelihood ratio, with an optional KL to the reference policy's step mean.

Per sample i (cfg: clip_range, adv_clip_max, kl_beta):

    A_i      = clamp(advantage_i, -adv_clip_max, adv_clip_max)
    ratio_i  = exp(log_prob_i - old_log_prob_i)
    policy_i = max(-A_i * ratio_i, -A_i * clamp(ratio_i, 1 - clip_range, 1 + clip_range))
    kl_i     = mean over the non-batch dims of (mean_i - ref_mean_i)^2 / (2 * std_i^2)    if kl_beta > 0
    loss     = mean_i of weight_i * (policy_i + kl_beta * kl_i)                          (weight_i = 1 if None)

kl_i is the KL term shared by every policy-gradient loss (policy_gradient.py `kl_to_reference`). Metrics: policy_loss,
kl_ref and the ratio metrics of policy_gradient.py `ratio_metrics` (ppo_kl, approx_kl, ratio_mean/std/min/max,
clip_fraction and its _higher / _lower sides).
"""

from dataclasses import dataclass

import torch

from diffusion_rl.algorithms.base import LossOutput, register_loss
from diffusion_rl.algorithms.policy_gradient import (
    ClippedLossSettings,
    PolicyGradient,
    PolicyLossInput,
    clipped_surrogate,
    kl_to_reference,
    policy_loss_output,
    ratio_metrics,
)


@dataclass
class FlowGrpoSettings(ClippedLossSettings):
    """Flow-GRPO's: clip range 1e-4, advantages clamped to ±5, no KL."""


@register_loss("flow_grpo", settings=FlowGrpoSettings, algorithm=PolicyGradient)
def flow_grpo_loss(inp: PolicyLossInput, cfg) -> LossOutput:
    """cfg needs clip_range, adv_clip_max and kl_beta."""
    clip_range, kl_beta = float(cfg.clip_range), float(cfg.kl_beta)
    kl_B = kl_to_reference(inp, kl_beta)

    # fp32: in bf16, exp() moves in steps of ~0.4%, coarser than clip ranges like 1e-4
    log_ratio_B = inp.log_prob.float() - inp.old_log_prob.float()
    ratio_B = torch.exp(log_ratio_B)
    adv_B = inp.advantages.float().clamp(-cfg.adv_clip_max, cfg.adv_clip_max)
    policy_B = clipped_surrogate(adv_B, ratio_B, clip_range)
    return policy_loss_output(inp, policy_B, kl_B, kl_beta, **ratio_metrics(log_ratio_B, ratio_B, clip_range))
