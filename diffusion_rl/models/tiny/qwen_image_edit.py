"""A tiny Qwen-Image-Edit (Plus) model: a real QwenImageEditPlusPipeline with random weights, for CPUs and tests.

The pieces of the tiny Qwen-Image (tiny/qwen_image.py) with what editing adds: the tokenizer knows the vision
tokens (<|vision_start|>, <|image_pad|>, <|vision_end|>) that the Qwen2.5-VL text encoder's config points to, its
merges are learned from the edit pipeline's own prompt template (whose system part is 64 tokens, as with the real
tokenizer) and the "Picture N:" labels, and a Qwen2-VL image processor shows the condition images to the encoder's
vision tower. The `2511` preset's transformer gives the condition tokens timestep 0 (`zero_cond_t`), as
Qwen-Image-Edit-2511's does. Saved as the family saves every pipeline of its kind (its registration's `save`): the
processor's files in processor/, listed in model_index.json as transformers' Qwen2VLProcessor.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusion_rl.models.tiny.qwen_image import (
    QWEN_IMAGE_SCHEDULER,
    SPECIAL_TOKENS,
    TinyQwenImageSpec,
    build_qwen_tokenizer,
    tiny_qwen_vae,
    tiny_text_encoder,
    tiny_transformer,
)

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PICTURE_LABELS = " ".join(f"Picture {i}:" for i in range(1, 4))  # how the pipeline numbers a prompt's images


@dataclass(frozen=True)
class TinyQwenImageEditSpec(TinyQwenImageSpec):
    zero_cond_t: bool = False  # Qwen-Image-Edit-2511: condition tokens at timestep 0


PRESETS = {
    "base": TinyQwenImageEditSpec(),  # ~2.5M-parameter transformer: the edit quickstart's model
    "small": TinyQwenImageEditSpec(layers=1, head_dim=16, heads=2, rope_axes=(4, 6, 6)),  # for the test suite
    "2511": TinyQwenImageEditSpec(layers=1, head_dim=16, heads=2, rope_axes=(4, 6, 6), zero_cond_t=True),
}


def prompt_template() -> str:
    """The chat template QwenImageEditPlusPipeline wraps each instruction in (its __init__ sets it; no weights)."""
    from diffusers import QwenImageEditPlusPipeline

    bare = QwenImageEditPlusPipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None
    )
    return bare.prompt_template_encode


def build(spec: TinyQwenImageEditSpec):
    """A QwenImageEditPlusPipeline of `spec`, its random weights drawn from the global RNG (see build_seeded)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from diffusion_rl.models.vl_processor import ImageTextProcessor

    tokenizer = build_qwen_tokenizer(f"{prompt_template()} {PICTURE_LABELS}", SPECIAL_TOKENS + VISION_TOKENS)
    ids = tokenizer.convert_tokens_to_ids
    vision_ids = {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }
    text_encoder = tiny_text_encoder(spec, tokenizer, vision_ids)  # in this order: each draws from the global RNG
    transformer = tiny_transformer(spec, zero_cond_t=spec.zero_cond_t)
    return QwenImageEditPlusPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        vae=tiny_qwen_vae(spec),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=ImageTextProcessor(Qwen2VLImageProcessorPil(), tokenizer),
        transformer=transformer,
    )
