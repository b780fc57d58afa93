"""Flash-GRPO (He et al., "Flash-GRPO: Efficient Alignment for Video Diffusion via One-Step Policy Optimization",
ICML 2026, arXiv 2605.15980): Flow-GRPO trained on ONE stochastic step per rollout, the same step for every
rollout of a group, with the policy term rescaled so every step's gradient has the same size.

One step, iso-temporal: the sampler does it, not this file. `sampling.window.kind: random` with `size: 1` makes
one step k SDE and every other step ODE, k drawn per training step (uniform over [lo, hi)) and shared by every
row of the step, so every rollout of a group (and of the batch) is stochastic at the same k. The group advantage
then compares rollouts that differ only through their initial noise and their noise at k, never through k.
The authors draw k per prompt from the first half of the schedule; the quickstart's `hi = num_steps / 2` is theirs.

Temporal gradient rectification (`rectify`): the gradient of the `sde` step's log-prob with respect to the
velocity has the size |∂μ/∂v| / s_k, where s_k = std_k·√dt_k is the step's noise std and ∂μ/∂v = (1 + std_k²·
(1 − σ_k)/(2σ_k))·dt_k (the step's mean is affine in v). So every sample's policy term is weighted by

    c_k = s_k / |∂μ/∂v|_k        the inverse of that size, a property of the step (no gradient through it)
    w_i = c_{k_i} / c̄            c̄ = mean of c_j over every step j = 0 … num_steps − 2 of the run's schedule

and the per-sample gradient no longer grows as k moves to late, quiet steps. The rest is the `flow_grpo` loss:

    A_i      = clamp(advantage_i, -adv_clip_max, adv_clip_max)
    ratio_i  = exp(log_prob_i - old_log_prob_i)
    loss     = mean_i of w_i · (max(-A_i·ratio_i, -A_i·clamp(ratio_i, 1 - clip_range, 1 + clip_range)) + kl_beta·kl_i)

c_k is read off the step function itself (∂μ/∂v as the difference of its means at v = 1 and v = 0), so it is the
coefficient of exactly the step the rollout took. The authors divide by the mean of c over the batch the update
trains (their batch mixes steps, one per prompt); ours holds one step, where that mean would make every w_i 1, so
c̄ is the mean over the schedule: a constant of the run, the same reweighting across steps, another overall scale.
docs/flash_grpo.md lists each convention with its place in the authors' code.
Metrics: flow_grpo's, and flash/rectify_weight (the mean of w_i).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_rl.algorithms.base import register_loss
from diffusion_rl.algorithms.losses.flow_grpo import flow_grpo_loss
from diffusion_rl.algorithms.policy_gradient import ClippedLossSettings, PolicyGradient, gather_columns
from diffusion_rl.config.fields import Range, check, opt
from diffusion_rl.config.plugins import STEP_TYPES


@dataclass
class FlashGrpoSettings(ClippedLossSettings):
    clip_range: float = opt(
        1e-3, "PPO ratio clip range (the authors' Wan config: 1e-3).", within=Range(0, 100, lo_open=True)
    )
    rectify: bool = opt(True, "Temporal gradient rectification: weight each sample by c_k / mean c (docs).")

    def check_config(self, algorithm, sampling) -> None:
        w = sampling.window
        check(
            w.kind == "random" and w.size == 1,
            "algorithm.loss=flash_grpo trains one step per rollout, shared by the group: set "
            f"sampling.window.kind=random with sampling.window.size=1 (got kind={w.kind}, size={w.size}); lo/hi "
            "choose the range the step is drawn from",
        )


def step_coefficients(sigma: torch.Tensor, sigma_next: torch.Tensor, sde_type: str, noise_level: float):
    """c = noise std / |∂μ/∂v| of each step σ → σ_next (any shape), fp32: the inverse of the size of the step's
    log-prob gradient with respect to the velocity, read off the step function (its mean is affine in v)."""
    step = STEP_TYPES.get(sde_type)
    sigma_B, sigma_next_B = sigma.float().flatten(), sigma_next.float().flatten()
    zeros = torch.zeros(sigma_B.shape[0], 1)
    at_0 = step(zeros, zeros, sigma_B, sigma_next_B, noise_level, prev_sample=zeros)
    at_1 = step(zeros, torch.ones_like(zeros), sigma_B, sigma_next_B, noise_level, prev_sample=zeros)
    dmean_dv = (at_1.mean - at_0.mean)[:, 0].abs()
    noise_std = at_0.std * (sigma_B - sigma_next_B).sqrt()
    return (noise_std / dmean_dv).view(sigma.shape)


class FlashGrpo(PolicyGradient):
    """The policy-gradient update with each trained step's weight multiplied by its rectification weight w."""

    def __init__(self, section, spec, **context):
        super().__init__(section, spec, **context)
        self.mean_coefficient: float | None = None  # c̄, from the model's schedule on the first update

    def begin(self, batch, step):
        units, metrics = super().begin(batch, step)
        if not self.settings.rectify:
            return units, metrics
        s, traj = self.sampler, batch.traj
        if self.mean_coefficient is None:
            sigmas = self.model.sigma_schedule(s.num_steps, s.height, s.width, s.frames)
            every_step = step_coefficients(sigmas[:-2], sigmas[1:-1], s.sde_type, s.noise_level)  # j = 0 … T − 2
            self.mean_coefficient = float(every_step.mean())
        sigma, sigma_next = gather_columns(traj.sigmas, units.columns), gather_columns(traj.sigmas_next, units.columns)
        weight_BK = step_coefficients(sigma.cpu(), sigma_next.cpu(), s.sde_type, s.noise_level) / self.mean_coefficient
        units.step_weight = units.step_weight * weight_BK.to(units.step_weight.device)
        return units, {**metrics, "flash/rectify_weight": float(weight_BK.mean())}


register_loss("flash_grpo", settings=FlashGrpoSettings, algorithm=FlashGrpo, sde_only=True, metrics=("flash",))(
    flow_grpo_loss
)
