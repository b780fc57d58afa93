"""`estimate`'s text-encoder weights — what each pipeline loads onto the device beside the transformer — against
the real transformers classes built on the meta device from the same shipped configs, and against the parameter
counts the encoders' checkpoints publish (model cards / safetensors indexes)."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

import pytest
import torch

from diffusion_rl.estimate.architectures import from_shipped

FOLDER = resources.files("diffusion_rl.assets") / "architectures"
# Parameters as the pipelines load them, from the public checkpoints (not from our formulas)
PUBLISHED = {
    ("clip_text_model", 768): 123.06e6,  # openai/clip-vit-large-patch14's text model
    ("clip_text_model", 1280): 694.66e6 - 1280**2,  # laion CLIP-ViT-bigG-14's text model less its projection
    ("t5", 4096): 4.762e9,  # google/t5-v1_1-xxl, encoder
    ("umt5", 4096): 5.681e9,  # google/umt5-xxl, encoder (Wan)
    ("qwen2_5_vl", 3584): 8.292e9,  # Qwen/Qwen2.5-VL-7B-Instruct, whole (Qwen-Image)
    ("qwen3", 2560): 4.022e9,  # Qwen/Qwen3-4B (FLUX.2-klein-4B, Z-Image)
    ("mistral3", 5120): 24.01e9,  # mistralai/Mistral-Small-3.1-24B-Instruct-2503, whole (FLUX.2-dev)
}
SHIPPED = sorted(p.name.removesuffix(".json") for p in FOLDER.iterdir() if p.name.endswith(".json"))


def _configs(name: str) -> dict[str, dict]:
    """The shipped text encoders' configs of architecture `name` (following `same_as`)."""
    data = json.loads((FOLDER / f"{name}.json").read_text())
    while "components" not in data:
        data = json.loads((FOLDER / f"{data['same_as']}.json").read_text())
    return {k: v for k, v in data["components"].items() if k.startswith("text_encoder")}


def _width(config: dict) -> int:
    text = config.get("text_config", config)
    return text.get("hidden_size") or text["d_model"]


def _build(config: dict):
    """The transformers class the pipeline loads, from the shipped config (call it on the meta device)."""
    import transformers as t

    kind, keys = config["model_type"], {k: v for k, v in config.items() if k != "model_type"}
    if kind == "clip_text_model":  # SD3 loads it with a hidden² projection (0.2–0.5 % more), FLUX without
        return t.CLIPTextModel(t.CLIPTextConfig(**keys))
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
def test_text_encoder_weights_are_the_real_classes_and_the_published_counts(name):
    arch, configs = from_shipped(name), _configs(name)
    assert [e.name for e in arch.text_encoders] == sorted(configs)
    for encoder in arch.text_encoders:
        config = configs[encoder.name]
        real = _real_params(json.dumps(config, sort_keys=True))
        published = PUBLISHED[(config["model_type"], _width(config))]
        assert real == pytest.approx(published, rel=2e-3), (encoder.name, real)  # our configs build the checkpoints
        # what estimate counts leaves out only small pieces (SD3's CLIP projections, the vision merger): within 1 %
        assert encoder.weight_params == pytest.approx(real, rel=1e-2), (encoder.name, encoder.weight_params, real)
