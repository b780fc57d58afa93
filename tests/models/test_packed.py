"""Packed latents and the resolution-dependent σ shift of FLUX.1 and Qwen-Image, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_rl.models.base import distinct_texts
from diffusion_rl.models.packed import (
    latent_image_ids,
    pack_latents,
    packed_sigma_schedule,
    resolution_shift_mu,
    tokens_of,
    unpack_latents,
)
from diffusion_rl.models.tiny.flux import DEV_SCHEDULER, SCHNELL_SCHEDULER
from diffusion_rl.models.tiny.qwen_image import QWEN_IMAGE_SCHEDULER


def test_pack_unpack_round_trip_is_exact():
    z = torch.randn(3, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    packed = pack_latents(z)
    assert packed.shape == (3, 4, 6, 64)
    assert torch.equal(unpack_latents(packed), z)
    grid = torch.randn(2, 3, 5, 8)
    assert torch.equal(pack_latents(unpack_latents(grid)), grid)


def test_packed_channel_order_is_channel_then_patch_row_then_patch_column():
    # one 2×2 patch of C = 2 channels: token channel index = c·4 + dy·2 + dx
    z = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]]])  # [1, 2, 2, 2]
    assert pack_latents(z).flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    # two patches side by side: the token grid is row-major over patches
    z = torch.arange(8.0).reshape(1, 1, 2, 4)  # rows [0 1 2 3], [4 5 6 7]
    assert tokens_of(pack_latents(z)).tolist() == [[[0, 1, 4, 5], [2, 3, 6, 7]]]


def test_packing_matches_the_diffusers_pipelines():
    from diffusers import FluxPipeline, QwenImagePipeline

    z = torch.randn(2, 4, 6, 8, generator=torch.Generator().manual_seed(1))
    ours = tokens_of(pack_latents(z))
    assert torch.equal(ours, FluxPipeline._pack_latents(z, 2, 4, 6, 8))
    assert torch.equal(ours, QwenImagePipeline._pack_latents(z, 2, 4, 6, 8))
    # their unpack takes the image size in pixels: latents 6×8 at VAE factor 8 are 48×64 px
    assert torch.equal(unpack_latents(pack_latents(z)), FluxPipeline._unpack_latents(ours, 48, 64, 8))


def test_pack_rejects_an_odd_latent_size():
    with pytest.raises(ValueError, match="even"):
        pack_latents(torch.zeros(1, 4, 5, 6))


def test_latent_image_ids_are_zero_row_column():
    ids = latent_image_ids(2, 3, torch.device("cpu"))
    assert ids.tolist() == [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 1, 2]]


def test_resolution_shift_mu_is_linear_between_the_two_anchors():
    config = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}
    assert resolution_shift_mu(256, config) == pytest.approx(0.5)
    assert resolution_shift_mu(4096, config) == pytest.approx(1.15)
    assert resolution_shift_mu(1024, config) == pytest.approx(0.5 + 0.65 * 768 / 3840)  # 512 px FLUX: 0.63
    assert resolution_shift_mu(16, config) == pytest.approx(0.5 - 0.65 * 240 / 3840)


def _fresh(config):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**config)


def _exp_shift(mu: float, sigma: float) -> float:
    return math.exp(mu) / (math.exp(mu) + 1 / sigma - 1)


def test_flux_dev_schedule_is_evenly_spaced_then_shifted_by_mu():
    seq = 1024
    mu = 0.5 + 0.65 * (seq - 256) / 3840
    expected = [_exp_shift(mu, s) for s in (1.0, 2 / 3, 1 / 3)] + [0.0]
    got = packed_sigma_schedule(_fresh(DEV_SCHEDULER), 3, seq)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(expected, abs=1e-6)


def test_flux_schnell_schedule_has_no_shift():
    got = packed_sigma_schedule(_fresh(SCHNELL_SCHEDULER), 4, 4096)
    assert got.tolist() == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0], abs=1e-6)


def test_qwen_image_schedule_is_shifted_then_stretched_to_end_at_0_02():
    seq = 256
    mu = 0.5 + 0.4 * (seq - 256) / (8192 - 256)  # = base_shift 0.5
    shifted = [_exp_shift(mu, s) for s in (1.0, 2 / 3, 1 / 3)]
    scale = (1 - shifted[-1]) / (1 - 0.02)  # stretch 1 − σ so that the last σ lands on shift_terminal
    expected = [1 - (1 - s) / scale for s in shifted] + [0.0]
    got = packed_sigma_schedule(_fresh(QWEN_IMAGE_SCHEDULER), 3, seq)
    assert got.tolist() == pytest.approx(expected, abs=1e-6)
    assert got[-2] == pytest.approx(0.02, abs=1e-6)


def test_distinct_texts_indexes_each_row():
    texts, prompt_idx, negative_idx = distinct_texts(["a", "b", "a"], ["", "", "x"])
    assert texts == ["a", "b", "", "x"]
    assert prompt_idx.tolist() == [0, 1, 0] and negative_idx.tolist() == [2, 2, 3]
    texts, prompt_idx, negative_idx = distinct_texts(["a", "a"], None)
    assert texts == ["a"] and prompt_idx.tolist() == [0, 0] and negative_idx is None
    with pytest.raises(ValueError, match="1 negative prompts for 2 prompts"):
        distinct_texts(["a", "b"], [""])
