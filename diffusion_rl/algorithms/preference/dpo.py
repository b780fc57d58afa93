"""Diffusion-DPO on online pairs: prefer the chosen sample's denoising error over the rejected one's, relative
to a frozen reference.

For each pair p (cfg: dpo_beta), with both members noised at the same t and with the same eps by the caller:

    err^m_p   = mean over the non-batch dims of (v^m_p - u^m_p)^2       m in {theta, ref}, u = eps - x0
    inside_p  = -beta/2 * [(err^theta_w,p - err^ref_w,p) - (err^theta_l,p - err^ref_l,p)]
    loss      = mean_p of -log sigmoid(inside_p)

w is the chosen (higher-reward) member, l the rejected one. A lower error than the reference's on the chosen
sample, and a higher one on the rejected sample, raise inside_p. beta is in the thousands (2000 by default)
because per-sample error differences between policy and reference are small.

Metrics: dpo/implicit_acc (fraction of pairs with inside > 0), dpo/reward_chosen = mean of
-beta/2 * (err^theta_w - err^ref_w), dpo/reward_rejected (the same for l), dpo/margin = mean of inside.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from diffusion_rl.algorithms.losses.base import LossOutput
from diffusion_rl.algorithms.preference.base import (
    PREFERENCE_LOSSES,
    batch_rows,
    check_same_shape,
    detached,
    row_mean,
)


@dataclass
class DpoInput:
    """One micro-batch of P pairs; every tensor is [P, ...] with the same shape."""

    v_chosen: torch.Tensor  # policy velocity on the chosen sample's x_t, with grad
    v_rejected: torch.Tensor  # policy velocity on the rejected sample's x_t, with grad
    v_ref_chosen: torch.Tensor  # reference velocity, no grad
    v_ref_rejected: torch.Tensor  # reference velocity, no grad
    target_chosen: torch.Tensor  # u = eps - x0 of the chosen sample
    target_rejected: torch.Tensor  # u = eps - x0 of the rejected sample

    def __post_init__(self):
        batch_rows("v_chosen", self.v_chosen)
        check_same_shape(
            self.v_chosen,
            "v_chosen",
            v_rejected=self.v_rejected,
            v_ref_chosen=self.v_ref_chosen,
            v_ref_rejected=self.v_ref_rejected,
            target_chosen=self.target_chosen,
            target_rejected=self.target_rejected,
        )


def _error(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # fp32: the loss lives in differences of errors ~1e-3 apart, which bf16 rounds away
    return row_mean((v.float() - target.float()).pow(2))


@PREFERENCE_LOSSES.register("dpo")
def dpo_loss(inp: DpoInput, cfg) -> LossOutput:
    """cfg needs dpo_beta."""
    beta = float(cfg.dpo_beta)
    err_w_P = _error(inp.v_chosen, inp.target_chosen)
    err_l_P = _error(inp.v_rejected, inp.target_rejected)
    with torch.no_grad():
        err_ref_w_P = _error(inp.v_ref_chosen, inp.target_chosen)
        err_ref_l_P = _error(inp.v_ref_rejected, inp.target_rejected)

    reward_w_P = -0.5 * beta * (err_w_P - err_ref_w_P)
    reward_l_P = -0.5 * beta * (err_l_P - err_ref_l_P)
    inside_P = reward_w_P - reward_l_P
    loss = -F.logsigmoid(inside_P).mean()

    with torch.no_grad():
        metrics = {
            "dpo/implicit_acc": (inside_P > 0).float().mean(),
            "dpo/reward_chosen": reward_w_P.mean(),
            "dpo/reward_rejected": reward_l_P.mean(),
            "dpo/margin": inside_P.mean(),
        }
    return LossOutput(loss=loss, metrics=detached(metrics))


dpo_loss.input_type = DpoInput
