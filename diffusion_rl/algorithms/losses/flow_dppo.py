"""Flow-DPPO: the plain policy gradient -A * ratio with a KL trust region in place of PPO's ratio clip.

A sample is left out of the update when its step has already moved far from the rollout policy (the Gaussian
KL between the current and the rollout step distributions is at least kl_mask_threshold) AND its gradient would
move it further away (ratio > 1 with A > 0, or ratio < 1 with A < 0). Updates that pull back toward the rollout
policy always stay.

Per sample i (cfg: kl_mask_threshold, add_kl_coefficient, kl_beta):

    ratio_i  = exp(log_prob_i - old_log_prob_i)
    kl_i     = mean over the non-batch dims of (mean_i - old_mean_i)^2 / (2 * (std_i * sqrt_dt_i)^2)
               (add_kl_coefficient false: mean of (mean_i - old_mean_i)^2 / 2)
    masked_i = kl_i >= kl_mask_threshold and ((ratio_i > 1 and A_i > 0) or (ratio_i < 1 and A_i < 0))
    loss     = mean over ALL i of weight_i * ((1 - masked_i) * (-A_i * ratio_i) + kl_beta * klref_i)

- The advantages are NOT clamped and the ratio is not clipped: the mask is the only trust region.
- Masked samples stay in the mean's denominator, so masking lowers the loss's scale rather than re-weighting
  the kept samples. kl_i only decides the mask and is detached.
- Metrics: policy_loss, kl_ref, the ratio metrics of policy_gradient.py `ratio_metrics` (no clip fractions: no clip),
  dppo/masked_fraction (mean of masked_i) split into pos_masked_fraction (ratio > 1, A > 0) and
  neg_masked_fraction (ratio < 1, A < 0), dppo/far_fraction (mean of kl_i ≥ kl_mask_threshold, masked or not),
  dppo/kl_mean and dppo/kl_max of kl_i. The unmasked fraction is 1 − masked_fraction.
- klref_i is the KL term shared by every policy-gradient loss (policy_gradient.py `kl_to_reference`; kl_beta > 0
  needs ref_mean); it is never masked. Flow-DPPO's recipe runs with kl_beta 0.
"""

from dataclasses import dataclass

import torch

from diffusion_rl.algorithms.base import LossOutput, register_loss
from diffusion_rl.algorithms.policy_gradient import (
    PolicyGradient,
    PolicyLossInput,
    PolicyLossSettings,
    kl_to_reference,
    policy_loss_output,
    ratio_metrics,
    require_exact_anchor_means,
)
from diffusion_rl.config.fields import Range, opt
from diffusion_rl.metrics import MAX, declare_metrics

declare_metrics({"dppo/kl_max": MAX})


@dataclass
class FlowDppoSettings(PolicyLossSettings):
    kl_mask_threshold: float = opt(
        1e-5, "Mask a sample moving further when its KL to the rollout step ≥ this.", within=Range(0, 1e6)
    )
    add_kl_coefficient: bool = opt(True, "Divide the mean gap by 2(std·√dt)² (false: by 2).")

    def check_config(self, algorithm, sampling) -> None:
        require_exact_anchor_means(sampling, "flow_dppo", "its KL to the rollout step, against kl_mask_threshold")


@register_loss("flow_dppo", settings=FlowDppoSettings, algorithm=PolicyGradient, sde_only=True, metrics=("dppo",))
def flow_dppo_loss(inp: PolicyLossInput, cfg) -> LossOutput:
    """cfg needs kl_mask_threshold, add_kl_coefficient and kl_beta."""
    threshold = float(cfg.kl_mask_threshold)
    add_kl_coefficient = bool(cfg.add_kl_coefficient)
    kl_beta = float(cfg.kl_beta)
    if threshold < 0:
        raise ValueError(f"kl_mask_threshold must be ≥ 0, got {threshold}")

    # fp32: bf16 rounds away most of the ratio's distance from 1 and of the mean difference
    log_ratio_B = inp.log_prob.float() - inp.old_log_prob.detach().float()
    ratio_B = torch.exp(log_ratio_B)
    adv_B = inp.advantages.float()

    with torch.no_grad():
        sq_diff_BN = (inp.mean.float() - inp.old_mean.float()).pow(2).flatten(1)
        if add_kl_coefficient:
            noise_std_B = inp.std.float() * inp.sqrt_dt.float()
            kl_B = (sq_diff_BN / (2 * noise_std_B[:, None] ** 2)).mean(dim=1)
        else:
            kl_B = sq_diff_BN.mean(dim=1) / 2
        far_B = kl_B >= threshold
        pos_masked_B = far_B & (ratio_B > 1) & (adv_B > 0)
        neg_masked_B = far_B & (ratio_B < 1) & (adv_B < 0)
        masked_B = pos_masked_B | neg_masked_B

    policy_B = torch.where(masked_B, torch.zeros_like(ratio_B), -adv_B * ratio_B)
    kl_ref_B = kl_to_reference(inp, kl_beta)
    return policy_loss_output(
        inp,
        policy_B,
        kl_ref_B,
        kl_beta,
        **ratio_metrics(log_ratio_B, ratio_B, None),
        **{
            "dppo/masked_fraction": masked_B.float().mean(),
            "dppo/pos_masked_fraction": pos_masked_B.float().mean(),
            "dppo/neg_masked_fraction": neg_masked_B.float().mean(),
            "dppo/far_fraction": far_B.float().mean(),
            "dppo/kl_mean": kl_B.mean(),
            "dppo/kl_max": kl_B.max(),
        },
    )
