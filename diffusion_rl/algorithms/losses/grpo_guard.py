"""GRPO-Guard: Flow-GRPO's PPO-clip with the likelihood ratio re-centred and rescaled per step.

The plain per-step log-ratio of an SDE step has a mean that drifts away from 0 as the policy moves, and a size
that varies strongly with the step's noise; a fixed clip range then clips some steps much more than others.
GRPO-Guard (arXiv 2510.22319) adds back the drift of the step mean and multiplies the log-ratio by the step's
noise scale, then divides the policy term by dt so every step's gradient has a comparable size.

Per micro-batch at one step (cfg: clip_range, adv_clip_max, kl_beta), with means over the micro-batch's rows.
All rows must be at the same step: the update's k-th backward pass holds every row's k-th trained step, which is
one step for all rows only with `algorithm.timestep_selection: first` (the config refuses `random` with this loss).

    s        = mean(sqrt_dt) * mean(std)                                  one number per micro-batch and step
    bias_i   = mean over the non-batch dims of (mean_i - old_mean_i)^2 / (2 * s^2)
    ratio_i  = exp((log_prob_i - old_log_prob_i + bias_i) * s)
    A_i      = clamp(advantage_i, -adv_clip_max, adv_clip_max)
    policy_i = max(-A_i * ratio_i, -A_i * clamp(ratio_i, 1 - clip_range, 1 + clip_range)) / mean(sqrt_dt)^2
    kl_i     = mean over the non-batch dims of (mean_i - ref_mean_i)^2 / (2 * std_i^2)          if kl_beta > 0
    loss     = mean_i of weight_i * (policy_i + kl_beta * kl_i)                               (weight_i = 1 if None)

bias_i is computed per sample, as verl-omni does. flow_grpo's GRPO-Guard script reduces the squared mean
difference over an empty tuple of dims, which averages it over the whole batch; we follow verl-omni.
The KL term is the one of the `flow_grpo` loss (not divided by dt).

The default clip_range is 2e-6, not Flow-GRPO's 1e-4: the log-ratio is multiplied by s < 1, so the ratio stays
much closer to 1 than Flow-GRPO's and a clip range sized for Flow-GRPO would rarely clip.
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
    require_exact_anchor_means,
)
from diffusion_rl.config.fields import Range, check, opt


@dataclass
class GrpoGuardSettings(ClippedLossSettings):
    clip_range: float = opt(
        2e-6, "Clip range of the re-centred, rescaled ratio (GRPO-Guard's 2e-6).", within=Range(0, 100, lo_open=True)
    )

    def check_config(self, algorithm, sampling) -> None:
        # s = mean(√dt)·mean(std) is over a micro-batch's rows; the update's k-th backward pass holds every row's
        # k-th trained step, which is one step for all rows only with `first`
        check(
            algorithm.timestep_selection == "first",
            "algorithm.loss=grpo_guard needs algorithm.timestep_selection=first: its scale s = mean(√dt)·mean(std) "
            "over a micro-batch's rows assumes they are all at one step, and random trains a different subset of "
            "steps per sample",
        )
        require_exact_anchor_means(sampling, "grpo_guard", "its drift term, against a clip range of 2e-6")


@register_loss("grpo_guard", settings=GrpoGuardSettings, algorithm=PolicyGradient, sde_only=True)
def grpo_guard_loss(inp: PolicyLossInput, cfg) -> LossOutput:
    """cfg needs clip_range, adv_clip_max and kl_beta."""
    clip_range, kl_beta = float(cfg.clip_range), float(cfg.kl_beta)
    kl_B = kl_to_reference(inp, kl_beta)

    # The scale is a property of the step, not of the parameters: no gradient flows through it.
    sqrt_dt_mean = inp.sqrt_dt.detach().float().mean()
    scale = sqrt_dt_mean * inp.std.detach().float().mean()

    # fp32: the mean drift is tiny next to the means, and the rescaled ratio sits very close to 1
    drift_B = (inp.mean.float() - inp.old_mean.detach().float()).pow(2).flatten(1).mean(dim=1)
    bias_B = drift_B / (2 * scale**2)
    log_ratio_B = inp.log_prob.float() - inp.old_log_prob.detach().float()
    ratio_B = torch.exp((log_ratio_B + bias_B) * scale)

    adv_B = inp.advantages.float().clamp(-cfg.adv_clip_max, cfg.adv_clip_max)
    policy_B = clipped_surrogate(adv_B, ratio_B, clip_range) / sqrt_dt_mean**2
    # ppo_kl and approx_kl of the plain log-ratio, comparable with flow_grpo's; the rest of the clipped ratio
    return policy_loss_output(
        inp,
        policy_B,
        kl_B,
        kl_beta,
        **ratio_metrics(log_ratio_B, ratio_B, clip_range),
        **{"guard/bias_mean": bias_B.mean(), "guard/scale": scale},
    )
