"""A tiny FLUX.1 model: a real FluxPipeline with random weights, for CPUs and tests.

The same pieces as FLUX.1-dev (or -schnell) at toy sizes: a FluxTransformer2DModel with double- and single-stream
blocks (with or without the guidance embedding), an AutoencoderKL with FLUX's shift/scale factors, a CLIP text
encoder for the pooled vector and a T5 encoder for the tokens; the offline byte-level tokenizers of the tiny SD3.
The scheduler configs are those of the real checkpoints (dev: resolution-dependent shift; schnell: none).
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusion_rl.models.tiny.parts import build_tokenizers, tiny_autoencoder, tiny_clip_config, tiny_t5


@dataclass(frozen=True)
class TinyFluxSpec:
    double_layers: int = 2
    single_layers: int = 4
    head_dim: int = 32  # = the sum of rope_axes
    heads: int = 4
    rope_axes: tuple[int, int, int] = (8, 12, 12)
    guidance_embeds: bool = True  # FLUX.1-dev; False is FLUX.1-schnell
    latent_channels: int = 4
    vae_channels: tuple[int, ...] = (32, 32, 32)  # 3 blocks: 4× down-sampling
    clip_hidden: int = 32
    t5_hidden: int = 32
    text_layers: int = 2
    max_sequence_length: int = 32
    sample_size: int = 64


PRESETS = {
    "base": TinyFluxSpec(),  # ~2.3M-parameter transformer; small and schnell ~0.08M
    "small": TinyFluxSpec(double_layers=1, single_layers=1, head_dim=16, heads=2, rope_axes=(4, 6, 6)),  # tests
    "schnell": TinyFluxSpec(
        double_layers=1, single_layers=1, head_dim=16, heads=2, rope_axes=(4, 6, 6), guidance_embeds=False
    ),
}

# the scheduler configs of black-forest-labs/FLUX.1-dev and FLUX.1-schnell
DEV_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)
SCHNELL_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


def build(spec: TinyFluxSpec):
    """A FluxPipeline of `spec`, its random weights drawn from the global RNG (see build_seeded)."""
    from diffusers import FluxPipeline

    return FluxPipeline(**components(spec))


def components(spec: TinyFluxSpec) -> dict:
    """The pipeline components of a tiny FLUX.1 of `spec` (FLUX.1 Kontext has the same ones)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel

    clip_tok, t5_tok = build_tokenizers(spec.max_sequence_length)
    clip = CLIPTextModel(tiny_clip_config(spec, len(clip_tok), clip_tok.bos_token_id, clip_tok.eos_token_id))
    t5 = tiny_t5(spec, len(t5_tok))
    transformer = FluxTransformer2DModel(
        patch_size=1,  # the latents come in 2×2-packed already
        in_channels=spec.latent_channels * 4,
        num_layers=spec.double_layers,
        num_single_layers=spec.single_layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads,
        joint_attention_dim=spec.t5_hidden,
        pooled_projection_dim=spec.clip_hidden,
        guidance_embeds=spec.guidance_embeds,
        axes_dims_rope=spec.rope_axes,
    )
    vae = tiny_autoencoder(  # FLUX.1's VAE factors, no quant convs
        spec, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False, use_post_quant_conv=False
    )
    scheduler = FlowMatchEulerDiscreteScheduler(**(DEV_SCHEDULER if spec.guidance_embeds else SCHNELL_SCHEDULER))
    return dict(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
        transformer=transformer,
    )
