"""Pieces shared by the families whose transformer reads 2×2-packed latent tokens (FLUX.1, FLUX.2, Qwen-Image).

Packed latents: the VAE latent [C, H, W] cut into 2×2 patches, each patch one token of 4·C channels, ordered
(channel, row in patch, column in patch) — the order the FLUX and Qwen-Image transformers were trained on. We
keep a sample's latents as the token grid [H/2, W/2, 4·C]: the SDE math is elementwise so the layout does not
matter to it, and the grid keeps the image size that the transformer's positional ids need.

Resolution-dependent shift: these schedulers move σ towards 1 more the more tokens an image has,
σ' = e^μ / (e^μ + (1/σ − 1)), with μ linear in the token count between (base_image_seq_len, base_shift) and
(max_image_seq_len, max_shift).
"""

from __future__ import annotations

import numpy as np
import torch

from diffusion_rl.models.base import FlowModel, single_frame


def pack_latents(latents_BCHW: torch.Tensor) -> torch.Tensor:
    """VAE latents [B, C, H, W] → token grid [B, H/2, W/2, 4·C]."""
    B, C, H, W = latents_BCHW.shape
    if H % 2 or W % 2:
        raise ValueError(f"packing needs an even latent height and width, got {H}×{W}")
    patches = latents_BCHW.reshape(B, C, H // 2, 2, W // 2, 2)  # [B, C, h, dy, w, dx]
    return patches.permute(0, 2, 4, 1, 3, 5).reshape(B, H // 2, W // 2, C * 4)


def unpack_latents(grid_BhwK: torch.Tensor) -> torch.Tensor:
    """Token grid [B, h, w, 4·C] → VAE latents [B, C, 2h, 2w] (the inverse of `pack_latents`)."""
    B, h, w, K = grid_BhwK.shape
    if K % 4:
        raise ValueError(f"packed latents need 4·C channels, got {K}")
    patches = grid_BhwK.reshape(B, h, w, K // 4, 2, 2)  # [B, h, w, C, dy, dx]
    return patches.permute(0, 3, 1, 4, 2, 5).reshape(B, K // 4, h * 2, w * 2)


def tokens_of(grid_BhwK: torch.Tensor) -> torch.Tensor:
    """Token grid [B, h, w, K] → the transformer's token sequence [B, h·w, K] (row-major, a view)."""
    B, h, w, K = grid_BhwK.shape
    return grid_BhwK.reshape(B, h * w, K)


def latent_image_ids(h: int, w: int, device: torch.device) -> torch.Tensor:
    """FLUX's positional ids of the image tokens: [h·w, 3] rows (0, row, column), row-major like `tokens_of`."""
    rows = torch.arange(h, device=device, dtype=torch.float32)[:, None].expand(h, w)
    cols = torch.arange(w, device=device, dtype=torch.float32)[None, :].expand(h, w)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(h * w, 3)


def resolution_shift_mu(image_seq_len: int, scheduler_config) -> float:
    """μ for an image of `image_seq_len` tokens: linear through (base_len, base_shift) and (max_len, max_shift),
    with the scheduler config's anchors (diffusers' `calculate_shift`, as the FLUX and Qwen-Image pipelines)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return calculate_shift(
        image_seq_len,
        scheduler_config.get("base_image_seq_len", 256),
        scheduler_config.get("max_image_seq_len", 4096),
        scheduler_config.get("base_shift", 0.5),
        scheduler_config.get("max_shift", 1.15),
    )


def packed_sigma_schedule(scheduler, num_steps: int, image_seq_len: int) -> torch.Tensor:
    """σ_0 = 1 > … > σ_T = 0 [num_steps + 1], as the FLUX / Qwen-Image pipelines set their scheduler up.

    They start from σ evenly spaced in [1/T, 1] and let the scheduler apply its shift: the resolution-dependent
    one (μ) when the scheduler config asks for dynamic shifting, else its fixed `shift`; plus `shift_terminal`.
    `scheduler` is a fresh scheduler (set_timesteps changes its state).
    """
    sigmas = np.linspace(1.0, 1.0 / num_steps, num_steps)
    if scheduler.config.get("use_dynamic_shifting", False):
        scheduler.set_timesteps(sigmas=sigmas, mu=resolution_shift_mu(image_seq_len, scheduler.config), device="cpu")
    else:
        scheduler.set_timesteps(sigmas=sigmas, device="cpu")
    return scheduler.sigmas.float().cpu()


class PackedLatentModel(FlowModel):
    """What FLUX.1 and Qwen-Image share: latents as a 2×2-packed token grid [H/2, W/2, 4·C] and their σ schedule
    with the resolution-dependent shift. Subclasses set `latent_channels` and `vae_scale` (VAE down-sampling)."""

    latent_channels: int
    vae_scale: int

    def latent_shape(self, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        single_frame(self.family, frames)
        step = self.size_step(self.vae_scale, self.pipeline.transformer.config)  # VAE down-sampling, 2×2 packing
        if height % step or width % step:
            raise ValueError(f"height and width must be multiples of {step}, got {height}×{width}")
        return (height // step, width // step, self.latent_channels * 4)

    def _build_sigma_schedule(self, num_steps: int, height: int, width: int, frames: int) -> torch.Tensor:
        h, w, _ = self.latent_shape(height, width, frames)
        return packed_sigma_schedule(self.fresh_scheduler(), num_steps, h * w)
