"""A tiny Wan text-to-video model: a real WanPipeline with random weights, for CPUs and tests.

The same pieces as Wan-AI/Wan2.1-T2V-1.3B-Diffusers at toy sizes: a WanTransformer3DModel (self-attention over
frame × row × column tokens, cross-attention to the text), an AutoencoderKLWan (a causal 3-D VAE: 4× in time and,
here, 4× in space) and a UMT5 text encoder with the offline byte-level tokenizer of the tiny SD3. The `ti2v` preset
is shaped like Wan2.2-TI2V-5B instead: a residual VAE that folds 2×2 pixels into channels first (8× in space here)
and a pipeline that expands the timestep to every token (`expand_timesteps`); the `a14b` preset is shaped like
Wan2.2-T2V-A14B: two transformers of one architecture, the pipeline switching at `boundary_ratio`. The scheduler
is the checkpoints' UniPC with flow sigmas and their `flow_shift`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_rl.models.tiny.parts import build_tokenizers, tiny_t5


@dataclass(frozen=True)
class TinyWanSpec:
    layers: int = 4
    head_dim: int = 24  # Wan's rotary split: 2·(head_dim // 6) for rows and for columns, the rest for frames
    heads: int = 4
    latent_channels: int = 4  # the VAE's z_dim (16 in Wan 2.1, 48 in Wan 2.2's VAE)
    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 2, 2)  # two down-samplings: 4× in space (and in time, below)
    vae_residual: bool = False  # Wan 2.2's VAE: residual blocks after a 2×2 pixel fold (vae_patch_size 2)
    vae_patch_size: int | None = None
    expand_timesteps: bool = False  # Wan 2.2 TI2V: the pipeline gives every token its own timestep
    flow_shift: float = 3.0  # Wan2.1-T2V-1.3B's; Wan2.2-TI2V-5B uses 5.0
    boundary_ratio: float | None = None  # Wan 2.2 A14B: a second transformer (the low-noise expert) below it
    t5_hidden: int = 32
    text_layers: int = 2
    max_sequence_length: int = 32


PRESETS = {
    "base": TinyWanSpec(),  # ~0.8M-parameter transformer: the video quickstart's model
    "small": TinyWanSpec(layers=1, head_dim=12, heads=2),  # for the test suite
    "ti2v": TinyWanSpec(
        layers=1, head_dim=12, heads=2, vae_residual=True, vae_patch_size=2, expand_timesteps=True, flow_shift=5.0
    ),
    # Wan2.2-T2V-A14B's layout: two experts switched at 0.875 · 1000, Wan 2.1's VAE, flow_shift 12
    "a14b": TinyWanSpec(layers=1, head_dim=12, heads=2, boundary_ratio=0.875, flow_shift=12.0),
}


def build(spec: TinyWanSpec):
    """A WanPipeline of `spec`, its random weights drawn from the global RNG (see build_seeded)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    _, tokenizer = build_tokenizers(spec.max_sequence_length)
    text_encoder = tiny_t5(spec, len(tokenizer), umt5=True)
    inner = spec.head_dim * spec.heads
    architecture = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=spec.heads,
        attention_head_dim=spec.head_dim,
        in_channels=spec.latent_channels,
        out_channels=spec.latent_channels,
        text_dim=spec.t5_hidden,
        freq_dim=32,
        ffn_dim=inner * 2,
        num_layers=spec.layers,
        rope_max_seq_len=64,
    )
    transformer = WanTransformer3DModel(**architecture)
    experts = {}
    if spec.boundary_ratio is not None:
        experts = dict(transformer_2=WanTransformer3DModel(**architecture), boundary_ratio=spec.boundary_ratio)
    downsamples = len(spec.vae_dim_mult) - 1
    fold = spec.vae_patch_size or 1
    generator = torch.Generator().manual_seed(0)  # fixed per-channel statistics, like a trained VAE's
    vae = AutoencoderKLWan(
        base_dim=spec.vae_base_dim,
        z_dim=spec.latent_channels,
        dim_mult=list(spec.vae_dim_mult),
        num_res_blocks=1,
        temperal_downsample=[True] * downsamples,
        latents_mean=[round(float(x), 4) for x in 0.5 * torch.randn(spec.latent_channels, generator=generator)],
        latents_std=[round(float(x), 4) for x in 1 + torch.rand(spec.latent_channels, generator=generator)],
        is_residual=spec.vae_residual,
        patch_size=spec.vae_patch_size,
        in_channels=3 * fold * fold,  # RGB of each fold×fold pixel patch as channels
        out_channels=3 * fold * fold,
        scale_factor_temporal=2**downsamples,
        scale_factor_spatial=2**downsamples * fold,
    )
    # the scheduler config of the Wan checkpoints (UniPC on flow sigmas with a fixed shift)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=spec.flow_shift, num_train_timesteps=1000
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        expand_timesteps=spec.expand_timesteps,
        **experts,
    )
