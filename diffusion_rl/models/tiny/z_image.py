"""A tiny Z-Image model: a real ZImagePipeline with random weights, for CPUs and tests.

The same pieces as Tongyi-MAI/Z-Image-Turbo at toy sizes: a ZImageTransformer2DModel (single-stream, with its
noise and context refiners), the FLUX.1 AutoencoderKL layout (16 channels there, no quant convs, scaling 0.3611,
shift 0.1159), a Qwen3 text encoder whose second-to-last hidden states the pipeline reads, and a Qwen2 byte-level
BPE tokenizer built offline with a chat template that writes what Qwen3's does for one user message with
`enable_thinking=True` (`<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n`). The scheduler config
is the real checkpoint's. Z-Image and Z-Image-Turbo share every class and config: Turbo is a sampling preset
(8 steps, no CFG; docs/models.md), not another model layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusion_rl.models.tiny.parts import tiny_autoencoder
from diffusion_rl.models.tiny.qwen_image import QWEN3_CHAT_TEMPLATE, build_qwen_tokenizer


@dataclass(frozen=True)
class TinyZImageSpec:
    layers: int = 4
    refiner_layers: int = 1
    heads: int = 4
    head_dim: int = 16  # = the sum of rope_axes
    rope_axes: tuple[int, int, int] = (4, 6, 6)
    rope_lengths: tuple[int, int, int] = (512, 64, 64)  # caption positions come first on axis 0
    latent_channels: int = 4  # 16 in Z-Image
    vae_channels: tuple[int, ...] = (32, 32)  # 2× down-sampling; the 2×2 patch makes 4 px a token side
    text_hidden: int = 32
    text_layers: int = 2
    sample_size: int = 32


PRESETS = {
    "base": TinyZImageSpec(),  # ~0.1M-parameter transformer
    "small": TinyZImageSpec(layers=1, heads=2),  # for the test suite
}

# the scheduler config of Tongyi-MAI/Z-Image-Turbo (scheduler/scheduler_config.json): a fixed shift of 3
Z_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def build(spec: TinyZImageSpec):
    """A ZImagePipeline of `spec`, its random weights drawn from the global RNG (see build_seeded)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = build_qwen_tokenizer("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE  # the pipeline passes enable_thinking=True
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=spec.text_hidden,
            intermediate_size=spec.text_hidden * 2,
            num_hidden_layers=spec.text_layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=spec.text_hidden // 2,
            max_position_embeddings=2048,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=spec.latent_channels,
        dim=spec.heads * spec.head_dim,
        n_layers=spec.layers,
        n_refiner_layers=spec.refiner_layers,
        n_heads=spec.heads,
        n_kv_heads=spec.heads,
        cap_feat_dim=spec.text_hidden,
        axes_dims=list(spec.rope_axes),
        axes_lens=list(spec.rope_lengths),
    )
    vae = tiny_autoencoder(spec, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False,
                           use_post_quant_conv=False)  # fmt: skip
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
