"""A tiny Wan image-to-video model: a real WanImageToVideoPipeline with random weights, for CPUs and tests.

The pieces of the tiny Wan text-to-video model (tiny/wan.py) with what the first frame adds, as in
Wan-AI/Wan2.1-I2V-14B-480P-Diffusers at toy sizes: a transformer that reads 2·C + 4 channels (its latents, the
first frame's video latents and a 4-channel mask) and cross-attends to a CLIP vision encoder's image tokens
(`image_dim`, `added_kv_proj_dim`), that CLIPVisionModel (image_encoder/) and its CLIPImageProcessor
(image_processor/). Wan 2.2 TI2V-5B's image mode needs no model of its own: its checkpoint is the text-to-video
one (tiny/wan.py's `ti2v` preset), which `model.family: wan_i2v` loads as this family. The `a14b` preset is shaped
like Wan2.2-I2V-A14B: the mask and first-frame channels without CLIP, two experts switched at `boundary_ratio`. The
`flf2v` preset is laid out as Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers: the I2V transformer with `pos_embed_seq_len` =
2 × the CLIP encoder's tokens (a first and a last frame's, one sequence with a learned positional embedding, drawn
here: diffusers starts it at zeros, which would make the two images' order invisible to cross-attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_rl.models.families.wan_i2v import MASK_CHANNELS
from diffusion_rl.models.tiny.wan import TinyWanSpec
from diffusion_rl.models.tiny.wan import build as build_text_to_video


@dataclass(frozen=True)
class TinyWanI2VSpec(TinyWanSpec):
    clip_hidden: int = 32  # the vision encoder's width (1280 in Wan 2.1 I2V's ViT-H), the transformer's image_dim
    clip_layers: int = 2  # the pipeline reads the second-to-last layer's hidden states
    clip_image_size: int = 32  # 224 in the real one (257 tokens); here (32 / 8)² + 1 = 17
    clip_patch: int = 8
    image_tokens: bool = True  # Wan 2.1 I2V's CLIP image tokens (Wan 2.2 I2V-A14B reads none)
    last_frame: bool = False  # Wan 2.1 FLF2V: a first and a last frame's CLIP tokens (pos_embed_seq_len)


PRESETS = {
    "base": TinyWanI2VSpec(),  # ~0.8M-parameter transformer: the image-to-video quickstart's model
    "small": TinyWanI2VSpec(layers=1, head_dim=12, heads=2, clip_hidden=16, clip_layers=2),  # for the test suite
    # Wan2.2-I2V-A14B's layout: two experts switched at 0.9 · 1000, no image encoder, flow_shift 5
    "a14b": TinyWanI2VSpec(layers=1, head_dim=12, heads=2, image_tokens=False, boundary_ratio=0.9, flow_shift=5.0),
    # Wan2.1-FLF2V-14B-720P's layout at the small preset's sizes: first and last frame
    "flf2v": TinyWanI2VSpec(layers=1, head_dim=12, heads=2, clip_hidden=16, clip_layers=2, last_frame=True),
}


def image_encoder(spec: TinyWanI2VSpec):
    """The CLIP vision tower and its image processor (random weights from the global RNG)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=spec.clip_hidden,
            intermediate_size=spec.clip_hidden * 2,
            num_hidden_layers=spec.clip_layers,
            num_attention_heads=2,
            image_size=spec.clip_image_size,
            patch_size=spec.clip_patch,
        )
    )
    size = spec.clip_image_size
    return encoder, CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def build(spec: TinyWanI2VSpec):
    """A WanImageToVideoPipeline of `spec`, its random weights drawn from the global RNG (see build_seeded)."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    t2v = build_text_to_video(spec)  # tokenizer, text encoder, VAE and scheduler as the text-to-video model's
    components = {name: getattr(t2v, name) for name in ("tokenizer", "text_encoder", "vae", "scheduler")}
    config = dict(t2v.transformer.config)
    c = spec.latent_channels
    inner = spec.head_dim * spec.heads
    keep = ("patch_size", "num_attention_heads", "attention_head_dim", "text_dim", "freq_dim", "ffn_dim",
            "num_layers", "rope_max_seq_len")  # fmt: skip
    architecture = {k: config[k] for k in keep} | dict(in_channels=2 * c + MASK_CHANNELS, out_channels=c)
    if spec.image_tokens:
        encoder, processor = image_encoder(spec)
        architecture |= dict(image_dim=spec.clip_hidden, added_kv_proj_dim=inner)
        components |= dict(image_encoder=encoder, image_processor=processor)
    if spec.last_frame:
        architecture["pos_embed_seq_len"] = 2 * ((spec.clip_image_size // spec.clip_patch) ** 2 + 1)
    if spec.boundary_ratio is not None:
        components |= dict(transformer_2=WanTransformer3DModel(**architecture), boundary_ratio=spec.boundary_ratio)
    transformer = WanTransformer3DModel(**architecture)
    if spec.last_frame:
        torch.nn.init.normal_(transformer.condition_embedder.image_embedder.pos_embed)
    return WanImageToVideoPipeline(**components, transformer=transformer)
