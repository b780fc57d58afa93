"""The tiny SD3 model: built from configs, saved with save_pretrained, loaded back unchanged; loader errors."""

from __future__ import annotations

import json

import pytest
import torch

from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.errors import UserError
from diffusion_rl.models.loader import load_model
from diffusion_rl.models.tiny import build_tiny

COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3")


def _load_pipeline(path):
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline.from_pretrained(path)


def _n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_saved_tiny_model_loads_back_bit_identical(tiny_model_dir):
    # tiny_model_dir was saved from the small preset with seed 0; building it again gives the same weights
    built = build_tiny("sd3", "small", seed=0)
    loaded = _load_pipeline(tiny_model_dir)
    for name in COMPONENTS:
        expected, actual = getattr(built, name).state_dict(), getattr(loaded, name).state_dict()
        assert expected.keys() == actual.keys(), name
        for key, tensor in expected.items():
            assert actual[key].dtype == tensor.dtype, f"{name}.{key}"
            assert torch.equal(actual[key], tensor), f"{name}.{key} changed through save/load"


def test_tiny_build_depends_on_the_seed():
    a = build_tiny("sd3", "small", seed=0).transformer.state_dict()
    b = build_tiny("sd3", "small", seed=1).transformer.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_tiny_build_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny("sd3", "small", seed=0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(("preset", "low", "high"), [("base", 2.2e6, 2.4e6), ("small", 0.25e6, 0.35e6)])
def test_tiny_preset_transformer_sizes(preset, low, high):
    pipeline = build_tiny("sd3", preset, seed=0)
    assert low < _n_params(pipeline.transformer) < high


def test_tokenizers_round_trip_through_save_and_load(tiny_model_dir):
    built = build_tiny("sd3", "small", seed=0)
    loaded = _load_pipeline(tiny_model_dir)
    prompt = "A red cube, on a blue Table! 42"
    for name in TOKENIZERS:
        expected = getattr(built, name)(prompt).input_ids
        assert getattr(loaded, name)(prompt).input_ids == expected, name
        assert len(expected) > 3  # not just the special tokens
    assert built.tokenizer_3.unk_token_id not in built.tokenizer_3(prompt).input_ids  # T5 covers plain ASCII


def test_load_model_builds_lora_on_the_sd3_targets(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir), device="cpu", lora=LoraConfig(enabled=True, rank=2, alpha=4))
    model = load_model(cfg)
    assert model.family == "sd3"
    names = [n for n, p in model.policies.trained.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and ".default." in n for n in names)
    assert any("attn.to_q" in n for n in names) and any("attn.add_k_proj" in n for n in names)


def test_load_model_without_model_index_names_what_it_found(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match="no model_index.json") as info:
        load_model(ModelConfig(path=str(tmp_path), device="cpu"))
    assert "notes.txt" in str(info.value) and "weights.safetensors" in str(info.value)


def test_load_model_rejects_an_unsupported_pipeline_and_lists_the_supported(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(UserError, match="StableDiffusionXLPipeline") as info:
        load_model(ModelConfig(path=str(tmp_path), device="cpu"))
    supported = (
        "supported: FluxPipeline (flux), Flux2KleinPipeline (flux2), FluxKontextPipeline (flux_kontext), "
        "QwenImagePipeline (qwen_image), QwenImageEditPlusPipeline (qwen_image_edit), StableDiffusion3Pipeline (sd3), "
        "WanPipeline (wan), WanImageToVideoPipeline (wan_i2v), ZImagePipeline (z_image)"
    )
    assert supported in str(info.value)


def test_load_model_rejects_an_unreadable_model_index(tmp_path):
    (tmp_path / "model_index.json").write_text("{not json")
    with pytest.raises(UserError, match="model_index.json"):
        load_model(ModelConfig(path=str(tmp_path), device="cpu"))


def test_load_model_on_a_file_says_it_is_a_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    with pytest.raises(UserError, match="is a file"):
        load_model(ModelConfig(path=str(path), device="cpu"))


def test_load_model_on_a_missing_dir_suggests_init_tiny(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(UserError, match="does not exist") as info:
        load_model(ModelConfig(path=str(missing), device="cpu"))
    assert f"init-tiny {missing}" in str(info.value)
