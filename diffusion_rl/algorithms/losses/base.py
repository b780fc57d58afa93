"""The shared signature of policy losses: `fn(inp: PolicyLossInput, cfg) -> LossOutput`, registered in LOSSES.

`cfg` is any object carrying the attributes the loss reads (e.g. the algorithm section of the config); each loss
documents which. The trainer never special-cases a loss name.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_rl.registry import Registry


@dataclass
class PolicyLossInput:
    """One training micro-batch at one denoising step; B = samples in the micro-batch."""

    log_prob: torch.Tensor  # [B] current policy's log-prob of the rollout's next latent, with grad
    old_log_prob: torch.Tensor  # [B] the same under the rollout (or recomputed old) policy, no grad
    advantages: torch.Tensor  # [B]
    mean: torch.Tensor  # [B, ...] current policy's SDE step mean, with grad
    old_mean: torch.Tensor  # [B, ...] rollout policy's step mean, no grad
    ref_mean: torch.Tensor | None  # [B, ...] reference policy's step mean, no grad; None when KL is off
    std: torch.Tensor  # [B] the step's std_dev_t, WITHOUT sqrt(dt)
    sqrt_dt: torch.Tensor  # [B] sqrt(|dt|) of the step: the noise std is std * sqrt_dt
    weights: torch.Tensor | None = None  # [B] rollout-correction weights (detached), multiply the per-sample loss

    def __post_init__(self):
        batch = self.log_prob.shape
        if len(batch) != 1:
            raise ValueError(f"log_prob must be [B]; got {tuple(batch)}")
        for name in ("old_log_prob", "advantages", "std", "sqrt_dt", "weights"):
            value = getattr(self, name)
            if value is not None and value.shape != batch:
                raise ValueError(f"{name} must be [B] = {tuple(batch)}; got {tuple(value.shape)}")
        for name in ("mean", "old_mean", "ref_mean"):
            value = getattr(self, name)
            if value is not None and (value.ndim < 1 or value.shape[0] != batch[0]):
                raise ValueError(f"{name} must be [B, ...] with B = {batch[0]}; got {tuple(value.shape)}")
        if self.ref_mean is not None and self.ref_mean.shape != self.mean.shape:
            raise ValueError(f"ref_mean {tuple(self.ref_mean.shape)} must have mean's shape {tuple(self.mean.shape)}")


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, to call backward on
    metrics: dict[str, torch.Tensor]  # scalar tensors, detached; reduced (and synced) by the caller


LossFn = Callable[[PolicyLossInput, Any], LossOutput]

LOSSES: Registry[LossFn] = Registry("loss")
