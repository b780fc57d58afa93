"""Phase 1 of pretraining: the autoencoder learns to reconstruct ShapesWorld images, then sets its latent scale."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def to_pixels(images_BHW3: np.ndarray) -> Tensor:
    """uint8 [B, H, W, 3] → float32 [B, 3, H, W] in [-1, 1]."""
    return torch.from_numpy(images_BHW3).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def vae_loss(vae, pixels_B3HW: Tensor, kl_weight: float, generator: torch.Generator) -> tuple[Tensor, dict]:
    """Reconstruction MSE of a posterior sample, plus kl_weight × the KL to N(0, I) per latent element."""
    posterior = vae.encode(pixels_B3HW).latent_dist
    z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
    recon = vae.decode(z).sample
    mse = (recon - pixels_B3HW).pow(2).mean()
    kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()
    return mse + kl_weight * kl, {"vae/mse": mse.item(), "vae/kl": kl.item()}


@torch.no_grad()
def encode_mean(vae, pixels_B3HW: Tensor, chunk: int = 256) -> Tensor:
    """Posterior means (unscaled latents) of a batch, in chunks."""
    return torch.cat(
        [vae.encode(pixels_B3HW[i : i + chunk]).latent_dist.mean for i in range(0, len(pixels_B3HW), chunk)]
    )


@torch.no_grad()
def reconstruction_mse(vae, pixels_B3HW: Tensor) -> float:
    """MSE of decode(posterior mean) against the input: the deterministic reconstruction error."""
    return (vae.decode(encode_mean(vae, pixels_B3HW)).sample - pixels_B3HW).pow(2).mean().item()


@torch.no_grad()
def latent_stats(vae, pixels_B3HW: Tensor) -> tuple[float, float]:
    """(shift, scale) so that (z − shift)·scale has zero mean and unit std over these images' latents."""
    z = encode_mean(vae, pixels_B3HW)
    return z.mean().item(), 1.0 / z.std().item()
