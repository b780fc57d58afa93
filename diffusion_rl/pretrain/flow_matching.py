"""Flow matching, the pretraining objective: pure tensor functions.

x_σ = (1 − σ)·x0 + σ·ε with ε ~ N(0, I); the network's velocity v should match ε − x0; σ is drawn logit-normal
(σ = sigmoid(n), n ~ N(mean, std²)), which puts most training signal at mid noise levels (SD3's choice).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def logit_normal_sigmas(batch: int, mean: float, std: float, generator: torch.Generator) -> Tensor:
    """σ [B] in (0, 1): sigmoid of N(mean, std²) draws."""
    return torch.sigmoid(mean + std * torch.randn(batch, generator=generator))


def noisy_latents(x0_BCHW: Tensor, noise_BCHW: Tensor, sigma_B: Tensor) -> Tensor:
    """x_σ = (1 − σ)·x0 + σ·ε, σ per row."""
    sigma = sigma_B.view(-1, *([1] * (x0_BCHW.ndim - 1)))
    return (1 - sigma) * x0_BCHW + sigma * noise_BCHW


def flow_matching_loss(v_BCHW: Tensor, x0_BCHW: Tensor, noise_BCHW: Tensor) -> Tensor:
    """mean((v − (ε − x0))²) over every element."""
    return (v_BCHW.float() - (noise_BCHW - x0_BCHW)).pow(2).mean()


def cosine_lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then a cosine from 1 down to `min_ratio` at step `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
