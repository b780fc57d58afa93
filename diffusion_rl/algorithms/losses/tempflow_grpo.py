"""TempFlow-GRPO (He et al., "TempFlow-GRPO: When Timing Matters for GRPO in Flow Models", arXiv 2508.04324):
per-step credit by trajectory branching, and a noise-aware weight on the per-step policy term.

Branching is done by the sampler, not here: with `sampling.share_initial_noise: true` and an SDE window of one
step (`window.kind: random`, `size: 1`; `hi = lo + 1` fixes the step), every sample of a prompt's group starts
from the same noise and takes the same ODE steps up to the window's step k, so the group shares x_k exactly; at
k each sample draws its own SDE step, and ODE steps take every branch to its image. The group's rewards then
differ only through the step at k, and the group advantage A_i (algorithms/base.py) credits that step.

Per sample i at its branching step k (cfg: clip_range, adv_clip_max, kl_beta, noise_aware, noise_weight_scale):

    A_i      = clamp(advantage_i, -adv_clip_max, adv_clip_max)
    ratio_i  = exp(log_prob_i - old_log_prob_i)
    w_i      = noise_weight_scale * std_i * sqrt_dt_i     if noise_aware, else 1
    policy_i = w_i * max(-A_i * ratio_i, -A_i * clamp(ratio_i, 1 - clip_range, 1 + clip_range))
    kl_i     = mean over the non-batch dims of (mean_i - ref_mean_i)^2 / (2 * std_i^2)          if kl_beta > 0
    loss     = mean_i of weight_i * (policy_i + kl_beta * kl_i)                                 (weight_i = 1 if None)

std_i * sqrt_dt_i = σ_k·√Δt_k is the std of the noise the `sde` step adds (std = a·√(σ/(1 − σ))). The gradient
of the step's log-prob with respect to its mean is (x_{k+1} − μ)/(σ_k²Δt_k), of size 1/(σ_k√Δt_k): late, quiet
steps get the largest gradients although they change the image least. Multiplying by the noise std evens that
out and leaves the early, exploratory steps the larger share. The paper weights a step by its noise level
σ_k·√Δt_k; the exact form and the constant here are its authors' released code's (2.25 in scripts/train_sd3_pr.py
of github.com/Shredded-Pork/TempFlow-GRPO). The weight is a property of the step: no gradient flows through it.
It multiplies the policy term only, not the KL term, as the authors' code does.

Metrics: policy_loss, kl_ref, the ratio metrics of policy_gradient.py `ratio_metrics`, and tempflow/noise_weight (the
mean of w_i).
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
from diffusion_rl.config.fields import Range, check, opt


@dataclass
class TempflowGrpoSettings(ClippedLossSettings):
    noise_aware: bool = opt(True, "Weight the policy term by the step's noise std σ·√dt (times noise_weight_scale).")
    noise_weight_scale: float = opt(
        2.25, "The constant of the noise-aware weight (the authors' code: 2.25 for SD3 at noise level 0.7, 1.73 for "
        "FLUX at 0.9).", within=Range(0, 1000, lo_open=True),
    )  # fmt: skip
    require_branching: bool = opt(
        True,
        "Refuse configs that do not branch (a window of one step, share_initial_noise on); false: train any "
        "window with the noise-aware weight, the advantage then credits every window step alike.",
    )

    def check_config(self, algorithm, sampling) -> None:
        if not self.require_branching:
            return
        s = sampling
        why = " (or algorithm.tempflow_grpo.require_branching=false to train without branching)"
        check(
            s.share_initial_noise,
            "algorithm.loss=tempflow_grpo branches a group from one shared prefix: set "
            "sampling.share_initial_noise=true" + why,
        )
        check(
            s.window.kind in ("random", "sliding") and s.window.size == 1,
            "algorithm.loss=tempflow_grpo credits one branching step: set sampling.window.kind=random (or sliding) "
            f"with sampling.window.size=1 (got kind={s.window.kind}, size={s.window.size}); lo/hi choose the range "
            "of the step, hi = lo + 1 fixes it" + why,
        )


def noise_aware_weight(std: torch.Tensor, sqrt_dt: torch.Tensor, scale: float) -> torch.Tensor:
    """[B]: scale · std · √dt, the `sde` step's noise std times the constant, detached, in fp32."""
    return scale * std.detach().float() * sqrt_dt.detach().float()


@register_loss(
    "tempflow_grpo", settings=TempflowGrpoSettings, algorithm=PolicyGradient, sde_only=True, metrics=("tempflow",)
)
def tempflow_grpo_loss(inp: PolicyLossInput, cfg) -> LossOutput:
    """cfg needs clip_range, adv_clip_max, kl_beta, noise_aware and noise_weight_scale."""
    clip_range, kl_beta = float(cfg.clip_range), float(cfg.kl_beta)
    kl_B = kl_to_reference(inp, kl_beta)

    # fp32: in bf16, exp() moves in steps of ~0.4%, coarser than clip ranges like 1e-4
    log_ratio_B = inp.log_prob.float() - inp.old_log_prob.detach().float()
    ratio_B = torch.exp(log_ratio_B)
    adv_B = inp.advantages.float().clamp(-cfg.adv_clip_max, cfg.adv_clip_max)
    if cfg.noise_aware:
        noise_weight_B = noise_aware_weight(inp.std, inp.sqrt_dt, float(cfg.noise_weight_scale))
    else:
        noise_weight_B = torch.ones_like(ratio_B)
    policy_B = noise_weight_B * clipped_surrogate(adv_B, ratio_B, clip_range)
    return policy_loss_output(
        inp,
        policy_B,
        kl_B,
        kl_beta,
        **ratio_metrics(log_ratio_B, ratio_B, clip_range),
        **{"tempflow/noise_weight": noise_weight_B.mean()},
    )
