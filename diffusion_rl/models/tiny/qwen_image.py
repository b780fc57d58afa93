"""A tiny Qwen-Image model: a real QwenImagePipeline with random weights, for CPUs and tests.

The same pieces as Qwen/Qwen-Image at toy sizes: a QwenImageTransformer2DModel, an AutoencoderKLQwenImage (a
video VAE run on single frames) and a Qwen2.5-VL text encoder (a vision tower included, unused for text). The
tokenizer is a byte-level BPE built offline: the byte alphabet plus merges learned from the pipeline's own prompt
template, so that the template's system part is 34 tokens as with the real tokenizer and the pipeline's
`prompt_template_encode_start_idx` cuts exactly the template off. The scheduler config is the real checkpoint's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from diffusion_rl.models.tiny.parts import byte_level_alphabet

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3's chat template (FLUX.2 klein's and Z-Image's text encoders), reduced to what their pipelines ask of it: the
# messages, then the assistant's turn; with enable_thinking=False an empty think block
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@dataclass(frozen=True)
class TinyQwenImageSpec:
    layers: int = 4
    head_dim: int = 32  # = the sum of rope_axes
    heads: int = 4
    rope_axes: tuple[int, int, int] = (8, 12, 12)
    latent_channels: int = 4  # the VAE's z_dim (16 in Qwen-Image)
    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 2, 2)  # two down-samplings: 4×
    text_hidden: int = 32
    text_layers: int = 2
    sample_size: int = 64


PRESETS = {
    "base": TinyQwenImageSpec(),  # ~2.5M-parameter transformer
    "small": TinyQwenImageSpec(layers=1, head_dim=16, heads=2, rope_axes=(4, 6, 6)),  # ~0.05M: for the test suite
}

# the scheduler config of Qwen/Qwen-Image
QWEN_IMAGE_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)


def build_qwen_tokenizer(template: str, special_tokens: tuple[str, ...] = SPECIAL_TOKENS):
    """A Qwen2Tokenizer (byte-level BPE) from an in-memory vocabulary: no files, no download. Its merges are learned
    from `template` (a pipeline's prompt template), so the template's words are single tokens as with the real
    tokenizer and the pipeline's `prompt_template_encode_start_idx` cuts exactly the template's system part off."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    corpus = re.sub("|".join(re.escape(t) for t in special_tokens), "", template)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=4096, min_frequency=1, initial_alphabet=byte_level_alphabet(), show_progress=False
    )
    bpe.train_from_iterator([corpus], trainer)
    learned = json.loads(bpe.to_str())["model"]
    vocab = dict(learned["vocab"])
    for token in special_tokens:
        vocab[token] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(m) for m in learned["merges"]],
        model_max_length=2048,
        extra_special_tokens=list(special_tokens[1:]),
    )


def prompt_template() -> str:
    """The chat template QwenImagePipeline wraps each prompt in (its __init__ sets it; no weights needed)."""
    from diffusers import QwenImagePipeline

    bare = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    return bare.prompt_template_encode


def build(spec: TinyQwenImageSpec):
    """A QwenImagePipeline of `spec`, its random weights drawn from the global RNG (see build_seeded)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    tokenizer = build_qwen_tokenizer(prompt_template())
    vocab = len(tokenizer)
    # ids past the vocabulary: no text token is ever taken for an image placeholder
    vision_ids = dict(image_token_id=vocab + 1, video_token_id=vocab + 2, vision_start_token_id=vocab + 3,
                      vision_end_token_id=vocab + 4)  # fmt: skip
    text_encoder = tiny_text_encoder(spec, tokenizer, vision_ids)  # in this order: each draws from the global RNG
    transformer = tiny_transformer(spec)
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        vae=tiny_qwen_vae(spec),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def tiny_text_encoder(spec: TinyQwenImageSpec, tokenizer, vision_ids: dict[str, int]):
    """A Qwen2.5-VL of `spec.text_layers` layers (a one-block vision tower included); `vision_ids` name the ids of
    its image placeholder and vision start/end tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    hidden = spec.text_hidden
    head_dim = hidden // 2  # 2 attention heads; mrope splits half the head dim over (time, height, width)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=spec.text_layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope(head_dim // 2)},
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=hidden,
            fullatt_block_indexes=[0],
        ),
        **vision_ids,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def tiny_transformer(spec: TinyQwenImageSpec, **extra):
    """The QwenImageTransformer2DModel of `spec` (`extra`: e.g. Qwen-Image-Edit-2511's zero_cond_t)."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=spec.latent_channels * 4,
        out_channels=spec.latent_channels,
        num_layers=spec.layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads,
        joint_attention_dim=spec.text_hidden,
        axes_dims_rope=spec.rope_axes,
        **extra,
    )


def tiny_qwen_vae(spec: TinyQwenImageSpec):
    """The AutoencoderKLQwenImage of `spec`, with fixed per-channel statistics like a trained VAE's."""
    from diffusers import AutoencoderKLQwenImage

    downsamples = len(spec.vae_dim_mult) - 1
    generator = torch.Generator().manual_seed(0)
    return AutoencoderKLQwenImage(
        base_dim=spec.vae_base_dim,
        z_dim=spec.latent_channels,
        dim_mult=list(spec.vae_dim_mult),
        num_res_blocks=1,
        temperal_downsample=[False] * downsamples,
        latents_mean=[round(float(x), 4) for x in 0.5 * torch.randn(spec.latent_channels, generator=generator)],
        latents_std=[round(float(x), 4) for x in 1 + torch.rand(spec.latent_channels, generator=generator)],
    )


def _mrope(half_head_dim: int) -> list[int]:
    """Split half a head's rotary dims over (time, height, width) like Qwen2.5-VL's [16, 24, 24] of 64."""
    time = half_head_dim // 4
    rest = half_head_dim - time
    return [time, rest // 2, rest - rest // 2]
