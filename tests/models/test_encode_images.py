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


@pytest.fixture(params=["tiny", "sd35"])
def factors(request, model):
    """The tiny SD3's VAE factors (scale 1, shift 0: a swapped shift and scale would pass unseen), then
    stable-diffusion-3.5-medium's (assets/architectures) on the same VAE."""
    config = model.vae.config
    kept = config.scaling_factor, config.shift_factor
    if request.param == "sd35":
        model.vae.register_to_config(scaling_factor=1.5305, shift_factor=0.0609)
    yield model.vae.config.scaling_factor, model.vae.config.shift_factor
    model.vae.register_to_config(scaling_factor=kept[0], shift_factor=kept[1])


def test_encode_gives_the_scaled_vae_mean_in_the_models_latent_shape(model, factors):
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    latents = model.encode(images)
    assert latents.shape == (2, *model.latent_shape(32, 32)) and latents.dtype == torch.float32
    assert torch.equal(model.encode(images), latents)  # deterministic: the posterior mean, not a sample

    # by hand: pixels in [-1, 1] channels-first, the VAE posterior's mean, then (z - shift) * scale
    vae = model.vae
    pixels = images.permute(0, 3, 1, 2).float() / 255 * 2 - 1
    with torch.no_grad():
        mean = vae.encode(pixels).latent_dist.mean
    scale, shift = factors
    torch.testing.assert_close(latents, (mean - shift) * scale)
    # decode reads what encode writes: the VAE's decoding of the posterior mean, as the pipeline's z / scale + shift
    with torch.no_grad():
        decoded = images_to_uint8(vae.decode(mean).sample)
    assert (model.decode(latents).int() - decoded.int()).abs().max() <= 1
