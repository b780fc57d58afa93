"""Trajectory latents kept in a half type (`sampling.latents_dtype`): half the memory of the stored window.

A kept trajectory's largest tensors are `latents` [B, W+1, …] and `means` [B, W, …]. With bf16 or fp16 storage
they are recorded in that dtype and read back as fp32 by the update; log-probs, stds and sigmas stay fp32.

Rounding only what is stored would make the update's recomputed log-prob differ from the rollout's even on-policy
(the recomputation would see a rounded x_j and x_{j+1}). So inside the SDE window the sample itself is the rounded
one: x_j is rounded before the window step's velocity, the drawn x_{j+1} is rounded, and the recorded log-prob is
that of the rounded x_{j+1}. The update then replays the rollout exactly (ratio 1 on-policy, as with fp32 storage);
the samples differ from fp32 storage's by that rounding (a relative 2⁻⁹ for bf16, 2⁻¹² for fp16, far below the
step's noise). The stored means are rounded copies of fp32 means: a loss that reads them as the PPO anchor's mean
sees that rounding on-policy; grpo_guard's drift term and flow_dppo's KL mask read it at the scale of the step
noise, where bf16's rounding is about their thresholds, so those losses refuse bf16 and take fp16
(algorithms/losses/base.py: `require_exact_anchor_means`).
"""

from __future__ import annotations

import torch

from diffusion_rl.sampling.sde import Generators, StepOutput, get_step
from diffusion_rl.utils.dtypes import DTYPES


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `sampling.latents_dtype` name."""
    if name not in DTYPES:
        raise ValueError(f"unknown latents dtype '{name}'; known: {', '.join(DTYPES)}")
    return DTYPES[name]


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as its storage dtype would hold it, in fp32 (x itself when the storage is fp32)."""
    return x if dtype == torch.float32 else x.to(dtype).float()


def stored_step(
    kind: str,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: float,
    sigma_next: float,
    noise_level: float,
    generators: Generators,
    dtype: torch.dtype,
) -> StepOutput:
    """One SDE window step whose drawn sample is the one storage keeps: x_{j+1} rounded to `dtype`, with the
    log-prob of that rounded sample (x, the step's input, must already be rounded). fp32: the plain step."""
    step = get_step(kind)
    out = step(x, v, sigma, sigma_next, noise_level, generator=generators)
    if dtype == torch.float32:
        return out
    # the noise is drawn once above; this call only scores the rounded sample under the same Gaussian
    return step(x, v, sigma, sigma_next, noise_level, prev_sample=rounded(out.prev_sample, dtype))
