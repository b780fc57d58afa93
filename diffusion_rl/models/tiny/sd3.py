"""The tiny SD3: a real StableDiffusion3Pipeline with a few million random weights, for CPUs and tests.

Made from configs (tiny/parts.py: no download); `diffusion-rl init-tiny` writes it with `save_pretrained`, and
everything else loads it from that directory through the same SD3 adapter a real Stable Diffusion 3.5 checkpoint
goes through. The `sd35` preset is laid out as stabilityai/stable-diffusion-3.5-medium at the small preset's sizes:
dual-attention blocks (a second, image-only self-attention `attn2`) in its first layer, RMS q/k norms, and the
VAE's latent factors (scaling 1.5305, shift 0.0609) without quant convs.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusion_rl.models.tiny.parts import build_tokenizers, tiny_autoencoder, tiny_clip_config, tiny_t5


@dataclass(frozen=True)
class TinySpec:
    """Sizes of the tiny model. The defaults give a ~2.3M-parameter transformer at 64 px (learns in minutes on CPU)."""

    layers: int = 4
    head_dim: int = 32
    heads: int = 4
    patch_size: int = 2
    latent_channels: int = 4
    vae_channels: tuple[int, ...] = (32, 32, 32)  # 3 blocks: 4× down-sampling
    clip_hidden: int = 32
    t5_hidden: int = 64  # ≥ the two CLIP hidden sizes together: the pipeline pads CLIP up to T5's width
    text_layers: int = 2
    max_sequence_length: int = 32  # text length dominates cost at toy sizes
    sample_size: int = 64  # default image size in pixels
    dual_attention_layers: tuple[int, ...] = ()  # SD3.5-Medium: layers 0–12 of 24 have a second attention (attn2)
    qk_norm: str | None = None  # SD3.5: "rms_norm"
    vae_factors: tuple[float, float] = (1.0, 0.0)  # (scaling, shift); SD3.5's VAE: (1.5305, 0.0609)
    quant_convs: bool = True  # SD3.5's VAE has none


PRESETS = {
    "base": TinySpec(),  # 2.3M-parameter transformer: the quickstart's model
    "small": TinySpec(layers=2, heads=2),  # 0.3M: fast enough for the test suite
    # stable-diffusion-3.5-medium's layout at small's sizes
    "sd35": TinySpec(
        layers=2,
        heads=2,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
        vae_factors=(1.5305, 0.0609),
        quant_convs=False,
    ),
}


def build(spec: TinySpec):
    """A StableDiffusion3Pipeline of `spec`, its random weights drawn from the global RNG (see build_seeded)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    clip_tok, t5_tok = build_tokenizers(spec.max_sequence_length)
    vocab = len(clip_tok)

    def clip_encoder():
        return CLIPTextModelWithProjection(tiny_clip_config(spec, vocab, 512, 513, projection_dim=spec.clip_hidden))

    t5 = tiny_t5(spec, len(t5_tok))
    inner = spec.head_dim * spec.heads
    transformer = SD3Transformer2DModel(
        sample_size=spec.sample_size // 2 ** (len(spec.vae_channels) - 1),
        patch_size=spec.patch_size,
        in_channels=spec.latent_channels,
        out_channels=spec.latent_channels,
        num_layers=spec.layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads,
        joint_attention_dim=spec.t5_hidden,
        caption_projection_dim=inner,
        pooled_projection_dim=2 * spec.clip_hidden,
        pos_embed_max_size=32,
        dual_attention_layers=spec.dual_attention_layers,
        qk_norm=spec.qk_norm,
    )
    scaling, shift = spec.vae_factors
    convs = dict(use_quant_conv=spec.quant_convs, use_post_quant_conv=spec.quant_convs)
    vae = tiny_autoencoder(spec, shift_factor=shift, scaling_factor=scaling, **convs)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip_encoder(),
        tokenizer=clip_tok,
        text_encoder_2=clip_encoder(),
        tokenizer_2=clip_tok,
        text_encoder_3=t5,
        tokenizer_3=t5_tok,
    )
