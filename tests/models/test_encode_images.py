"""FlowModel.encode: uint8 images → latents in the space `decode` reads (VAE mean, then shift and scale)."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.models.base import images_to_uint8, uint8_to_images
from diffusion_rl.models.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(ModelConfig(path=str(tiny_model_dir), device="cpu", lora=LoraConfig(enabled=False)))


def test_uint8_round_trip_covers_every_value():
    values = torch.arange(256, dtype=torch.uint8).view(1, 16, 16, 1).expand(1, 16, 16, 3).contiguous()
    pixels = uint8_to_images(values)
    assert pixels.shape == (1, 3, 16, 16)
    assert pixels.min() == -1 and pixels.max() == 1 and pixels[0, 0, 0, 1] == pytest.approx(1 / 127.5 - 1)
    assert torch.equal(images_to_uint8(pixels), values)


def test_encode_gives_the_scaled_vae_mean_in_the_models_latent_shape(model):
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    latents = model.encode(images)
    assert latents.shape == (2, *model.latent_shape(32, 32)) and latents.dtype == torch.float32
    assert torch.equal(model.encode(images), latents)  # deterministic: the posterior mean, not a sample

    # by hand: pixels in [-1, 1] channels-first, the VAE posterior's mean, then (z - shift) * scale
    vae = model.vae
    pixels = images.permute(0, 3, 1, 2).float() / 255 * 2 - 1
    with torch.no_grad():
        mean = vae.encode(pixels).latent_dist.mean
    expected = (mean - vae.config.shift_factor) * vae.config.scaling_factor
    torch.testing.assert_close(latents, expected)
    assert model.decode(latents).shape == images.shape  # decode reads what encode writes
