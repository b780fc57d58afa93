"""A tiny FLUX.2-klein model: a real Flux2KleinPipeline with random weights, for CPUs and tests.

The same pieces as black-forest-labs/FLUX.2-klein-4B at toy sizes: a Flux2Transformer2DModel (double- and
single-stream blocks, shared modulations, 4-axis RoPE, no guidance embedding), an AutoencoderKLFlux2 (its batch-norm
statistics of the 2×2-patchified latents set to fixed values like a trained VAE's) and a Qwen3ForCausalLM text
encoder of 27 layers, so that the pipeline's default hidden-state layers (9, 18, 27) exist. The tokenizer is the
offline byte-level BPE of the tiny Qwen-Image with a chat template that renders a user turn as Qwen3's does
(`enable_thinking=False`: an empty think block). `base` and `small` are the step-distilled klein (`is_distilled`:
CFG-free); `small_undistilled` is klein base (true CFG with the empty prompt as negative). `dev` and `small_dev` are
FLUX.2-dev: a
Flux2Pipeline with the guidance embedding in the transformer and a Mistral-3 text encoder (models/tiny/mistral3.py)
behind a PixtralProcessor's tokenizer, the transformer reading its layers 10, 20 and 30.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_rl.models.tiny.qwen_image import QWEN3_CHAT_TEMPLATE, SPECIAL_TOKENS, build_qwen_tokenizer

THINK_TOKENS = ("<think>", "</think>")
TEXT_LAYERS = 27  # hidden_states[27] is the deepest layer the pipeline reads


@dataclass(frozen=True)
class TinyFlux2Spec:
    double_layers: int = 2
    single_layers: int = 4
    head_dim: int = 32  # = the sum of rope_axes
    heads: int = 4
    rope_axes: tuple[int, int, int, int] = (8, 8, 8, 8)
    latent_channels: int = 4  # 32 in FLUX.2
    vae_channels: tuple[int, ...] = (32, 32, 32)  # 3 blocks: 4× down-sampling
    text_hidden: int = 16
    distilled: bool = True  # klein (step-distilled, CFG-free); False: klein base
    dev: bool = False  # FLUX.2-dev: Flux2Pipeline, Mistral-3 text encoder, guidance embedding


_SMALL = dict(double_layers=1, single_layers=1, head_dim=16, heads=2, rope_axes=(4, 4, 4, 4))
PRESETS = {
    "base": TinyFlux2Spec(),  # ~1.9M-parameter transformer
    "small": TinyFlux2Spec(**_SMALL),  # ~0.06M: for the test suite
    "small_undistilled": TinyFlux2Spec(**_SMALL, distilled=False),
    "dev": TinyFlux2Spec(dev=True),  # FLUX.2-dev at base's size; a 30-layer Mistral-3 of 0.09M
    "small_dev": TinyFlux2Spec(**_SMALL, dev=True),  # ~0.07M: for the test suite
}

# FlowMatchEulerDiscreteScheduler as FLUX.2 uses it: dynamic shifting with the exponential time shift; the
# pipeline passes μ itself (its empirical fit of token count and step count), so the base/max anchors go unused
FLUX2_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")


def build(spec: TinyFlux2Spec):
    """A Flux2KleinPipeline (FLUX.2-dev: Flux2Pipeline) of `spec`, its random weights drawn from the global RNG
    (see build_seeded)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline

    if spec.dev:
        from diffusion_rl.models.tiny import mistral3

        tokenizer = mistral3.build_tokenizer()
        text_encoder = mistral3.build_text_encoder(tokenizer, spec.text_hidden)  # in this order: the global RNG
        transformer = tiny_transformer(spec)
        return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), vae=tiny_vae(spec),
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)  # fmt: skip
    tokenizer = build_qwen_tokenizer(QWEN3_CHAT_TEMPLATE + "user assistant", SPECIAL_TOKENS + THINK_TOKENS)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE  # the pipeline turns thinking off
    text_encoder = tiny_qwen3(spec, tokenizer)  # in this order: each draws from the global RNG
    transformer = tiny_transformer(spec)
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=tiny_vae(spec),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=spec.distilled,
    )


def tiny_qwen3(spec: TinyFlux2Spec, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_hidden * 2,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=spec.text_hidden // 2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config)


def tiny_transformer(spec: TinyFlux2Spec):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1,  # the latents come 2×2-patchified already
        in_channels=spec.latent_channels * 4,
        num_layers=spec.double_layers,
        num_single_layers=spec.single_layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads,
        joint_attention_dim=3 * spec.text_hidden,  # three hidden-state layers side by side
        axes_dims_rope=spec.rope_axes,
        guidance_embeds=spec.dev,  # klein has none; FLUX.2-dev has
    )


def tiny_vae(spec: TinyFlux2Spec):
    """The AutoencoderKLFlux2 of `spec`, its batch-norm running statistics fixed like a trained VAE's."""
    from diffusers import AutoencoderKLFlux2

    blocks = len(spec.vae_channels)
    vae = AutoencoderKLFlux2(
        block_out_channels=spec.vae_channels,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        layers_per_block=1,
        latent_channels=spec.latent_channels,
        norm_num_groups=8,
        sample_size=64,
    )
    generator = torch.Generator().manual_seed(0)
    channels = vae.bn.num_features
    vae.bn.running_mean.copy_(0.3 * torch.randn(channels, generator=generator))
    vae.bn.running_var.copy_(0.5 + torch.rand(channels, generator=generator))
    return vae
