"""Advantage-Weighted Matching (AWM): PPO-clip on a flow-matching "likelihood" of the forward process.

Each row n is one (timestep, sample) pair of a micro-batch: x_t = (1 - t_n) * x0 + t_n * eps, u = eps - x0.
With cfg: clip_range, adv_clip_max = c, advantage_max, weighting, kl_beta = beta_ref, ema_beta = beta_ema:

    mse_n      = mean over the non-batch dims of (v_theta,n - u_n)^2            float64
    log p_n    = awm_log_p(mse_n, t_n, weighting) = -w(mse_n, t_n)
    A^_n       = clamp(A_n, -c, c) / c * advantage_max
    ratio_n    = exp(log p_theta,n - log p_old,n)                                log p_old without gradient
    loss       = mean_n max(-A^_n * ratio_n, -A^_n * clamp(ratio_n, 1 - clip_range, 1 + clip_range))
                 + beta_ref * mean_n mean (v_theta - v_ref)^2 + beta_ema * mean_n mean (v_theta - v_ema)^2

Weightings w(mse, t): "uniform" mse; "t" t * mse; "ghuber" t * ((mse + 1e-10)^p - 1e-10^p) / p with p = 0.25
(a generalised Huber: it grows like mse^p, so rows with a large error do not dominate the gradient).

log p_old is computed by the caller with awm_log_p on a no_grad pass of the policy that sampled (same x_t, same
eps); on-policy it equals log p_theta in value, so the ratio is 1 and the loss is advantage-weighted matching.
AWM's reference recipes use clip_range 1 (the config default 1e-4 is Flow-GRPO's and would clip nearly every row).
The KL terms are the plain velocity gaps ("Uniform" in AWM's reference), not divided by a step variance.

Metrics: awm/ratio_mean, awm/clip_fraction (|ratio - 1| > clip_range), awm/mse (mean mse_theta),
awm/policy_loss, kl_ref (mean (v_theta - v_ref)^2, 0 without v_ref), awm/ema_gap (the same to v_ema).
"""

from dataclasses import dataclass

import torch

from diffusion_rl.algorithms.losses.base import LossOutput
from diffusion_rl.algorithms.preference.base import (
    PREFERENCE_LOSSES,
    batch_rows,
    check_same_shape,
    check_vectors,
    detached,
    row_mean,
)

WEIGHTINGS = ("uniform", "t", "ghuber")
GHUBER_POWER = 0.25
GHUBER_EPS = 1e-10  # keeps the power's gradient finite at mse = 0


@dataclass
class AwmInput:
    """One micro-batch flattened to N = (trained timesteps x samples) rows."""

    v: torch.Tensor  # [N, ...] policy velocity at x_t, with grad
    target: torch.Tensor  # [N, ...] u = eps - x0
    t: torch.Tensor  # [N] sigma in [0, 1] of each row
    log_p_old: torch.Tensor  # [N] awm_log_p under the weights that sampled, no grad
    advantages: torch.Tensor  # [N] the row's sample's advantage
    v_ref: torch.Tensor | None = None  # [N, ...] reference velocity, no grad; needed when kl_beta > 0
    v_ema: torch.Tensor | None = None  # [N, ...] EMA velocity, no grad; needed when ema_beta > 0

    def __post_init__(self):
        rows = batch_rows("v", self.v)
        check_same_shape(self.v, "v", target=self.target, v_ref=self.v_ref, v_ema=self.v_ema)
        check_vectors(rows, t=self.t, log_p_old=self.log_p_old, advantages=self.advantages)


def awm_log_p(mse: torch.Tensor, t: torch.Tensor, weighting: str) -> torch.Tensor:
    """[N], [N] -> [N] float64: -w(mse, t) for weighting in WEIGHTINGS (see the module docstring)."""
    # float64: on-policy the ratio is exp of a difference of two nearly equal numbers
    mse, t = mse.double(), t.double()
    if weighting == "uniform":
        return -mse
    if weighting == "t":
        return -t * mse
    if weighting == "ghuber":
        p = GHUBER_POWER
        return -t * ((mse + GHUBER_EPS) ** p - GHUBER_EPS**p) / p
    raise ValueError(f"unknown AWM weighting '{weighting}'; known: {', '.join(WEIGHTINGS)}")


def _gap(v: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
    """[N]: mean (v - other)^2 per row; zeros when other is None."""
    if other is None:
        return torch.zeros(v.shape[0], device=v.device)
    return row_mean((v.float() - other.detach().float()).pow(2))


@PREFERENCE_LOSSES.register("awm")
def awm_loss(inp: AwmInput, cfg) -> LossOutput:
    """cfg needs clip_range, adv_clip_max, advantage_max, weighting, kl_beta and ema_beta."""
    clip_range, c = float(cfg.clip_range), float(cfg.adv_clip_max)
    kl_beta, ema_beta = float(cfg.kl_beta), float(cfg.ema_beta)
    if c <= 0:
        raise ValueError(f"adv_clip_max must be > 0 (advantages are divided by it); got {c}")
    if kl_beta > 0 and inp.v_ref is None:
        raise ValueError("kl_beta > 0 needs v_ref (the reference policy's velocity); got None")
    if ema_beta > 0 and inp.v_ema is None:
        raise ValueError("ema_beta > 0 needs v_ema (the EMA policy's velocity); got None")

    mse_N = row_mean((inp.v.double() - inp.target.double()).pow(2))
    log_ratio_N = awm_log_p(mse_N, inp.t, cfg.weighting) - inp.log_p_old.detach().double()
    ratio_N = torch.exp(log_ratio_N)
    adv_N = inp.advantages.double().clamp(-c, c) / c * float(cfg.advantage_max)
    unclipped_N = -adv_N * ratio_N
    clipped_N = -adv_N * ratio_N.clamp(1.0 - clip_range, 1.0 + clip_range)
    policy = torch.maximum(unclipped_N, clipped_N).mean().float()

    kl_N, ema_N = _gap(inp.v, inp.v_ref), _gap(inp.v, inp.v_ema)
    loss = policy
    if kl_beta > 0:
        loss = loss + kl_beta * kl_N.mean()
    if ema_beta > 0:
        loss = loss + ema_beta * ema_N.mean()

    with torch.no_grad():
        metrics = {
            "awm/ratio_mean": ratio_N.mean().float(),
            "awm/clip_fraction": ((ratio_N - 1.0).abs() > clip_range).float().mean(),
            "awm/mse": mse_N.mean().float(),
            "awm/policy_loss": policy,
            "kl_ref": kl_N.mean(),
            "awm/ema_gap": ema_N.mean(),
        }
    return LossOutput(loss=loss, metrics=detached(metrics))


awm_loss.input_type = AwmInput
