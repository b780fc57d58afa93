"""DiffusionNFT: flow matching toward an implicit positive policy and away from an implicit negative one.

Per sample i of a micro-batch (cfg: nft_beta = beta, adv_clip_max = c, kl_beta = beta_KL):

    r_i     = clamp(clamp(A_i, -c, c) / (2c) + 1/2, 0, 1)          how much sample i counts as a positive
    v+      = beta * v_theta + (1 - beta) * v_old                    implicit positive policy
    v-      = (1 + beta) * v_old - beta * v_theta                    its mirror image around v_old
    x0+-    = x_t - t_i * v+-                                        their clean-sample predictions
    w+-_i   = max(mean |x0+- - x0|, 1e-5), without gradient          per-sample adaptive normaliser
    pol_i   = (r_i * mean (x0+ - x0)^2 / w+_i + (1 - r_i) * mean (x0- - x0)^2 / w-_i) / beta
    loss    = c * mean_i pol_i + beta_KL * mean_i mean (v_theta - v_ref)^2

means without an index run over the non-batch dims. c is a pure scale of the policy term; dividing by beta
cancels the beta that v+- bring into the gradient (d x0+- / d v_theta = -+ t * beta), so a small beta does not
shrink the update. v_old is the slowly-updated "old" adapter that sampled the rollouts (see schedules.old_decay);
v_ref is the frozen base model and is only needed when kl_beta > 0.

Metrics: nft/r_mean, nft/policy_loss (c * mean pol_i, the term in the loss), kl_ref (mean (v_theta - v_ref)^2,
0 without v_ref), nft/old_gap (mean (v_theta - v_old)^2).
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

MIN_WEIGHT = 1e-5  # floor of the adaptive normaliser: a near-perfect prediction must not blow the loss up


@dataclass
class NftInput:
    """One micro-batch of B samples at one forward-process time each."""

    v: torch.Tensor  # [B, ...] policy velocity at x_t, with grad
    v_old: torch.Tensor  # [B, ...] old-adapter velocity, no grad
    v_ref: torch.Tensor | None  # [B, ...] reference velocity, no grad; None when kl_beta = 0
    x_t: torch.Tensor  # [B, ...] (1 - t) * x0 + t * eps
    x0: torch.Tensor  # [B, ...] the rollout's clean final latent
    t: torch.Tensor  # [B] sigma in [0, 1]
    advantages: torch.Tensor  # [B]

    def __post_init__(self):
        batch = batch_rows("v", self.v)
        check_same_shape(self.v, "v", v_old=self.v_old, v_ref=self.v_ref, x_t=self.x_t, x0=self.x0)
        check_vectors(batch, t=self.t, advantages=self.advantages)


def reward_probability(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """[B] -> [B]: r = clamp(clamp(A, -c, c) / (2c) + 1/2, 0, 1); A = c gives 1, A = 0 gives 1/2, A = -c gives 0."""
    c = float(adv_clip_max)
    return (advantages.float().clamp(-c, c) / (2 * c) + 0.5).clamp(0.0, 1.0)


@PREFERENCE_LOSSES.register("nft")
def nft_loss(inp: NftInput, cfg) -> LossOutput:
    """cfg needs nft_beta, adv_clip_max and kl_beta."""
    beta, c, kl_beta = float(cfg.nft_beta), float(cfg.adv_clip_max), float(cfg.kl_beta)
    if beta <= 0:
        raise ValueError(f"nft_beta must be > 0 (the loss divides by it); got {beta}")
    if c <= 0:
        raise ValueError(f"adv_clip_max must be > 0 (r divides by it); got {c}")
    if kl_beta > 0 and inp.v_ref is None:
        raise ValueError("kl_beta > 0 needs v_ref (the reference policy's velocity); got None")

    # fp32: x0+ and x0- differ from each other by O(beta * t * |v - v_old|), far below bf16's resolution
    v, v_old = inp.v.float(), inp.v_old.detach().float()
    x_t, x0 = inp.x_t.float(), inp.x0.float()
    t_B1 = inp.t.float().view(-1, *([1] * (v.ndim - 1)))
    r_B = reward_probability(inp.advantages, c)

    x0_pos = x_t - t_B1 * (beta * v + (1 - beta) * v_old)
    x0_neg = x_t - t_B1 * ((1 + beta) * v_old - beta * v)
    with torch.no_grad():
        w_pos_B = row_mean((x0_pos - x0).abs()).clamp_min(MIN_WEIGHT)
        w_neg_B = row_mean((x0_neg - x0).abs()).clamp_min(MIN_WEIGHT)
    pos_B = row_mean((x0_pos - x0).pow(2)) / w_pos_B
    neg_B = row_mean((x0_neg - x0).pow(2)) / w_neg_B
    policy = c * ((r_B * pos_B + (1 - r_B) * neg_B) / beta).mean()

    if inp.v_ref is not None:
        kl_B = row_mean((v - inp.v_ref.detach().float()).pow(2))
    else:
        kl_B = torch.zeros_like(r_B)
    loss = policy + kl_beta * kl_B.mean() if kl_beta > 0 else policy

    with torch.no_grad():
        metrics = {
            "nft/r_mean": r_B.mean(),
            "nft/policy_loss": policy,
            "kl_ref": kl_B.mean(),
            "nft/old_gap": row_mean((v - v_old).pow(2)).mean(),
        }
    return LossOutput(loss=loss, metrics=detached(metrics))


nft_loss.input_type = NftInput
