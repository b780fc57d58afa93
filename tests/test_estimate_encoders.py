"""`estimate`'s frozen encoders' weights (text encoders, and Wan 2.1 I2V's CLIP image encoder) — what each pipeline
loads onto the device beside the transformer — against
the real transformers classes built on the meta device from the same shipped configs, and against the parameter
counts the encoders' checkpoints publish (model cards / safetensors indexes)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch

from diffusion_rl.estimate.architectures import from_shipped, shipped, shipped_doc

# Parameters as the pipelines load them, from the public checkpoints (not from our formulas)
PUBLISHED = {
    ("clip_text_model", 768): 123.06e6,  # openai/clip-vit-large-patch14's text model
    ("clip_text_model", 1280): 694.66e6 - 1280**2,  # laion CLIP-ViT-bigG-14's text model less its projection
    ("t5", 4096): 4.762e9,  # google/t5-v1_1-xxl, encoder
    ("umt5", 4096): 5.681e9,  # google/umt5-xxl, encoder (Wan)
    ("qwen2_5_vl", 3584): 8.292e9,  # Qwen/Qwen2.5-VL-7B-Instruct, whole (Qwen-Image)
    ("qwen3", 2560): 4.022e9,  # Qwen/Qwen3-4B (FLUX.2-klein-4B, Z-Image)
    ("mistral3", 5120): 24.01e9,  # mistralai/Mistral-Small-3.1-24B-Instruct-2503, whole (FLUX.2-dev)
    ("clip_vision_model", 1280): 632.08e6 - 1280 * 1024,  # open_clip ViT-H-14's visual tower less its projection
}
SHIPPED = sorted(shipped())


def _configs(name: str) -> dict[str, dict]:
    """The shipped encoders' configs of architecture `name` (another's with its `changes`, for a `same_as`)."""
    components = shipped_doc(name)["components"]
    return {k: v for k, v in components.items() if k.startswith(("text_encoder", "image_encoder"))}


def _width(config: dict) -> int:
    text = config.get("text_config", config)
    return text.get("hidden_size") or text["d_model"]


def _build(config: dict):
    """The transformers class the pipeline loads, from the shipped config (call it on the meta device)."""
    import transformers as t

    kind, keys = config["model_type"], {k: v for k, v in config.items() if k not in ("model_type", "_class_name")}
    if kind == "clip_text_model":  # SD3 loads it with a hidden² projection (0.2–0.5 % more), FLUX without
        return t.CLIPTextModel(t.CLIPTextConfig(**keys))
    if kind == "clip_vision_model":  # Wan 2.1 I2V's image_encoder/
        return t.CLIPVisionModel(t.CLIPVisionConfig(**keys))
    if kind == "t5":
        return t.T5EncoderModel(t.T5Config(**keys))
    if kind == "umt5":
        return t.UMT5EncoderModel(t.UMT5Config(**keys))
    if kind == "qwen3":
        return t.Qwen3ForCausalLM(t.Qwen3Config(**keys))
    if kind == "qwen2_5_vl":
        vision, tie = keys.pop("vision_config"), keys.pop("tie_word_embeddings")
        config = t.Qwen2_5_VLConfig(text_config=keys, vision_config=vision, tie_word_embeddings=tie)
        return t.Qwen2_5_VLForConditionalGeneration(config)
    if kind == "mistral3":
        text = {k: v for k, v in keys["text_config"].items() if k != "model_type"}
        vision = {k: v for k, v in keys["vision_config"].items() if k != "model_type"}
        config = t.Mistral3Config(text_config=t.MistralConfig(**text), vision_config=t.PixtralVisionConfig(**vision),
                                  spatial_merge_size=keys["spatial_merge_size"],
                                  tie_word_embeddings=keys["tie_word_embeddings"])  # fmt: skip
        return t.Mistral3ForConditionalGeneration(config)
    raise AssertionError(f"no real class for model_type {kind}")


@cache
def _real_params(config_json: str) -> int:
    with torch.device("meta"):  # shapes only: a 24B model in no memory
        model = _build(json.loads(config_json))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", SHIPPED)
def test_encoder_weights_are_the_real_classes_and_the_published_counts(name):
    arch, configs = from_shipped(name), _configs(name)
    encoders = [*arch.text_encoders, *([arch.image_encoder] if arch.image_encoder else [])]
    assert sorted(e.name for e in encoders) == sorted(configs)
    for encoder in encoders:
        config = configs[encoder.name]
        real = _real_params(json.dumps(config, sort_keys=True))
        published = PUBLISHED[(config["model_type"], _width(config))]
        assert real == pytest.approx(published, rel=2e-3), (encoder.name, real)  # our configs build the checkpoints
        # estimate leaves out only small pieces (SD3's CLIP projections, the vision merger, a ViT's embeddings): 1 %
        assert encoder.weight_params == pytest.approx(real, rel=1e-2), (encoder.name, encoder.weight_params, real)


def test_an_image_encoder_is_held_beside_the_text_encoders_and_offloaded_with_them():
    from diffusion_rl.config import load
    from diffusion_rl.estimate.architectures import architecture_for
    from diffusion_rl.estimate.devices import DEVICES
    from diffusion_rl.estimate.estimator import estimate

    configs = Path(__file__).resolve().parents[1] / "configs"
    i2v = load(str(configs / "wan21_i2v_lora.yaml"))
    arch = architecture_for(i2v.model)
    held = estimate(i2v, arch, DEVICES["h100"], 8)
    assert held.memory_gib["image_encoder"] == pytest.approx(arch.image_encoder.weight_params * 2 / 2**30)  # bf16
    offloaded = estimate(load(str(configs / "wan21_i2v_lora.yaml"), ["model.offload_frozen=true"]), arch,
                         DEVICES["h100"], 8)  # fmt: skip
    assert offloaded.memory_gib["image_encoder"] == 0
    assert held.peak_memory_gib_per_gpu - offloaded.peak_memory_gib_per_gpu == pytest.approx(
        sum(held.memory_gib[k] for k in ("text_encoders", "vae", "image_encoder"))
    )
    t2v = load(str(configs / "wan21_t2v_1_3b_ocr_lora.yaml"))
    assert "image_encoder" not in estimate(t2v, architecture_for(t2v.model), DEVICES["h100"], 8).memory_gib
