"""Qwen-Image: the tiny model round trip, its tokenizer, true CFG with the per-token norm rescale, text padding."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from diffusion_rl.models.families.qwen_image import norm_rescaled_cfg
from diffusion_rl.models.tiny import build_tiny


def test_saved_tiny_qwen_image_loads_back_bit_identical(qwen_image_model_dir):
    from diffusers import QwenImagePipeline

    built = build_tiny("qwen_image", "small", seed=0)
    loaded = QwenImagePipeline.from_pretrained(qwen_image_model_dir)
    for name in ("transformer", "vae", "text_encoder"):
        expected, actual = getattr(built, name).state_dict(), getattr(loaded, name).state_dict()
        assert expected.keys() == actual.keys(), name
        assert all(torch.equal(actual[k], v) for k, v in expected.items()), name
    text = "A red cube, on a blue Table! 42 café"
    assert loaded.tokenizer(text).input_ids == built.tokenizer(text).input_ids
    assert json.loads((qwen_image_model_dir / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"


def test_tokenizer_makes_the_template_prefix_exactly_the_tokens_the_pipeline_drops(qwen_image_model_dir):
    from diffusers import QwenImagePipeline

    pipeline = QwenImagePipeline.from_pretrained(qwen_image_model_dir)
    template, drop = pipeline.prompt_template_encode, pipeline.prompt_template_encode_start_idx
    prefix = template.split("{}")[0]
    ids = pipeline.tokenizer(prefix).input_ids
    assert len(ids) == drop == 34
    assert pipeline.tokenizer.decode(ids) == prefix
    full = pipeline.tokenizer(template.format("a red apple")).input_ids
    assert full[:drop] == ids  # the prompt starts right after the dropped part
    assert pipeline.tokenizer.decode(full[drop:]).startswith("a red apple<|im_end|>")


def test_norm_rescaled_cfg_by_hand():
    # u = 0, c = (3, 4), s = 2: u + s(c − u) = (6, 8), norm 10, rescaled to |c| = 5 → (3, 4)
    out = norm_rescaled_cfg(torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, 4.0]]), 2.0)
    assert torch.allclose(out, torch.tensor([[3.0, 4.0]]))
    # u = (1, 0), c = (0, 1), s = 3: (1 − 3, 3) = (−2, 3), norm √13, |c| = 1 → (−2, 3)/√13
    out = norm_rescaled_cfg(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), 3.0)
    assert torch.allclose(out, torch.tensor([[-2.0, 3.0]]) / math.sqrt(13))
    u = torch.tensor([[[0.0, 0.0], [1.0, 0.0]]])
    c = torch.tensor([[[3.0, 4.0], [0.0, 1.0]]])
    expected = torch.tensor([[[3.0, 4.0], [-2 / math.sqrt(13), 3 / math.sqrt(13)]]])
    # per token: with s = 3 the first token gives (9, 12) → (3, 4), the second (−2, 3) → (−2, 3)/√13
    assert torch.allclose(norm_rescaled_cfg(u, c, 3.0), expected)


def test_guided_velocity_is_cfg_rescaled_per_token_to_the_conditional_norm(qwen_image_model_dir, load):
    model = load(qwen_image_model_dir)
    forwards = []
    model.pipeline.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: forwards.append(kwargs), with_kwargs=True
    )
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["a red cube", "a lighthouse at dusk on a cliff"], ["blurry", ""])
    negative_as_positive = TensorDict(
        {
            "prompt_embeds": cond["negative_prompt_embeds"],
            "prompt_embeds_mask": cond["negative_prompt_embeds_mask"],
        },
        [2],
    )
    scale = 4.0
    with torch.no_grad():
        guided = model.velocity(x, 0.7, cond, scale)
        v_cond = model.velocity(x, 0.7, cond, 1.0)
        v_uncond = model.velocity(x, 0.7, negative_as_positive, 1.0)
    assert forwards[0]["hidden_states"].shape[0] == 4  # one forward over [uncond; cond]
    B, h, w, K = guided.shape
    expected = torch.empty_like(guided)
    for b in range(B):  # token by token: combine, then scale to the conditional velocity's length
        for i in range(h):
            for j in range(w):
                u, c = v_uncond[b, i, j], v_cond[b, i, j]
                combined = u + scale * (c - u)
                expected[b, i, j] = combined * (c.norm() / combined.norm())
    assert torch.allclose(guided, expected, atol=1e-5)
    assert not torch.allclose(guided, v_uncond + scale * (v_cond - v_uncond), atol=1e-3)  # the rescale matters


def test_text_padding_and_batch_neighbours_do_not_change_a_prompts_velocity(qwen_image_model_dir, load):
    model = load(qwen_image_model_dir)
    x = torch.randn(1, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    short = model.encode_prompts(["a cat"], [""])
    assert short["prompt_embeds"].shape[1] == model.max_sequence_length == 16
    assert short["prompt_embeds_mask"].sum() < 16 and not short["prompt_embeds_mask"][0, -1]
    both = model.encode_prompts(["a cat", "a lighthouse at dusk above a stormy sea with gulls"], ["", ""])
    assert torch.equal(both["prompt_embeds_mask"][0], short["prompt_embeds_mask"][0])
    with torch.no_grad():
        alone = model.velocity(x, 0.6, short, 4.0)
        in_batch = model.velocity(torch.cat([x, x]), 0.6, both, 4.0)[:1]
    assert torch.allclose(alone, in_batch, atol=1e-5)


def test_prompt_longer_than_max_sequence_length_is_cut(qwen_image_model_dir, load):
    model = load(qwen_image_model_dir)
    cond = model.encode_prompts(["word " * 40])
    assert cond["prompt_embeds"].shape[1] == 16 and bool(cond["prompt_embeds_mask"].all())


def test_decode_undoes_the_latent_normalisation_of_one_frame(qwen_image_model_dir, load):
    model = load(qwen_image_model_dir)
    vae = model.pipeline.vae
    latents = torch.randn(1, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    z = latents.reshape(1, 4, 4, 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(1, 4, 8, 8)  # unpacked by hand
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 4, 1, 1)
    with torch.no_grad():
        pixels = vae.decode((z * std + mean)[:, :, None], return_dict=False)[0][:, :, 0]
    expected = ((pixels / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(model.decode(latents), expected)
    assert model.encode(model.decode(latents)).shape == latents.shape


def test_latent_shape_is_the_packed_token_grid(qwen_image_model_dir, load):
    model = load(qwen_image_model_dir)
    assert model.latent_shape(32, 64) == (4, 8, 16)
    with pytest.raises(ValueError, match="multiples of 8"):
        model.latent_shape(32, 44)


# Qwen/Qwen-Image-2512's public model_index.json (its components) and scheduler/scheduler_config.json
QWEN_IMAGE_2512_INDEX = {
    "_class_name": "QwenImagePipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}
QWEN_IMAGE_2512_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                                 max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                 time_shift_type="exponential")  # fmt: skip


def test_a_model_laid_out_like_qwen_image_2512_loads_through_the_qwen_image_family(tmp_path, load, monkeypatch):
    """2512 is new weights for QwenImagePipeline: the tiny Qwen-Image is laid out as its checkpoint is (the same
    components and scheduler config), loads as `qwen_image`, and `estimate` reads the shipped 2512 architecture."""
    from diffusion_rl.config import load as load_config
    from diffusion_rl.estimate.architectures import architecture_for, from_shipped
    from diffusion_rl.models.tiny import save_tiny

    directory = save_tiny(tmp_path / "Qwen-Image-2512", "qwen_image", "small", seed=0)
    index = json.loads((directory / "model_index.json").read_text())
    assert {k: v for k, v in index.items() if k != "_diffusers_version"} == QWEN_IMAGE_2512_INDEX
    (directory / "model_index.json").write_text(json.dumps({**index, "_diffusers_version": "0.36.0.dev0"}))
    scheduler = json.loads((directory / "scheduler" / "scheduler_config.json").read_text())
    assert {k: scheduler[k] for k in QWEN_IMAGE_2512_SCHEDULER} == QWEN_IMAGE_2512_SCHEDULER
    assert load(directory).family == "qwen_image"

    monkeypatch.chdir(tmp_path)  # no models/Qwen-Image-2512 here: estimate falls back to the shipped architecture
    ready = load_config(str(Path(__file__).resolve().parents[2] / "configs/qwen_image_2512_ocr_lora.yaml"))
    arch = architecture_for(ready.model)
    qwen = from_shipped("Qwen-Image")
    assert (arch.name, arch.family, arch.transformer_config, arch.vae_config) == (
        "Qwen-Image-2512", "qwen_image", qwen.transformer_config, qwen.vae_config
    )  # fmt: skip
    assert arch.text_encoders == qwen.text_encoders and "Qwen-Image-2512" in arch.source
