"""FLUX.1: the tiny model round trip, σ and guidance as the network sees them, schnell's true CFG, VAE scaling."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tensordict import TensorDict

from diffusion_rl.models.tiny import build_tiny


def _sinusoid(values: list[float], dim: int = 256) -> torch.Tensor:
    """The [cos, sin] timestep features of FLUX's time projection, by hand: frequencies 10000^(−k/128)."""
    half = dim // 2
    rows = []
    for value in values:
        args = [value * math.exp(-math.log(10000) * k / half) for k in range(half)]
        rows.append([math.cos(a) for a in args] + [math.sin(a) for a in args])
    return torch.tensor(rows, dtype=torch.float32)


def _record_forward_kwargs(module) -> list[dict]:
    calls = []
    module.register_forward_pre_hook(lambda _, args, kwargs: calls.append(kwargs), with_kwargs=True)
    return calls


def _capture_inputs(module) -> list[torch.Tensor]:
    seen = []
    module.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach().clone()))
    return seen


def test_saved_tiny_flux_loads_back_bit_identical(flux_model_dir):
    from diffusers import FluxPipeline

    built = build_tiny("flux", "small", seed=0)
    loaded = FluxPipeline.from_pretrained(flux_model_dir)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        expected, actual = getattr(built, name).state_dict(), getattr(loaded, name).state_dict()
        assert expected.keys() == actual.keys(), name
        assert all(torch.equal(actual[k], v) for k, v in expected.items()), name
    prompt = "A red cube, on a blue Table! 42"
    for name in ("tokenizer", "tokenizer_2"):
        assert getattr(loaded, name)(prompt).input_ids == getattr(built, name)(prompt).input_ids
    assert json.loads((flux_model_dir / "model_index.json").read_text())["_class_name"] == "FluxPipeline"


def test_dev_takes_sigma_and_guidance_scaled_by_1000_in_one_forward(flux_model_dir, load):
    model = load(flux_model_dir)
    assert model.guidance_embeds
    embed = model.pipeline.transformer.time_text_embed
    time_in, guidance_in = _capture_inputs(embed.timestep_embedder), _capture_inputs(embed.guidance_embedder)
    guidance_out = []
    embed.guidance_embedder.register_forward_hook(lambda _, __, out: guidance_out.append(out.detach().clone()))
    forwards = _record_forward_kwargs(model.pipeline.transformer)

    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["a red cube", "a blue ball"])
    with torch.no_grad():
        v_35 = model.velocity(x, torch.tensor([0.6, 0.25]), cond, guidance=3.5)
        v_1 = model.velocity(x, torch.tensor([0.6, 0.25]), cond, guidance=1.0)

    assert len(forwards) == 2 and all(kw["hidden_states"].shape[0] == 2 for kw in forwards)  # no CFG batch
    assert forwards[0]["guidance"].tolist() == [3.5, 3.5]
    # what the embedders see: the sinusoidal features of 1000·σ and of 1000·guidance
    assert torch.allclose(time_in[0], _sinusoid([600.0, 250.0]), atol=2e-4)
    assert torch.allclose(guidance_in[0], _sinusoid([3500.0, 3500.0]), atol=1e-3)
    assert torch.allclose(guidance_in[1], _sinusoid([1000.0, 1000.0]), atol=1e-3)
    # and the guidance embedding itself: linear_2(silu(linear_1(features)))
    mlp = embed.guidance_embedder
    features = _sinusoid([3500.0])
    hidden = features @ mlp.linear_1.weight.T + mlp.linear_1.bias
    expected = (hidden * torch.sigmoid(hidden)) @ mlp.linear_2.weight.T + mlp.linear_2.bias
    assert torch.allclose(guidance_out[0][0], expected[0], atol=1e-3)
    assert (v_35 - v_1).abs().max() > 1e-4  # the guidance reaches the velocity


def test_dev_uses_no_negative_prompt(flux_model_dir, load):
    model = load(flux_model_dir)
    x = torch.randn(1, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model.velocity(x, 0.5, model.encode_prompts(["a cat"], [""]), 3.5)
        b = model.velocity(x, 0.5, model.encode_prompts(["a cat"], ["ugly, blurry"]), 3.5)
    assert torch.equal(a, b)


def test_schnell_has_no_guidance_embedding_and_runs_true_cfg(flux_schnell_model_dir, load):
    model = load(flux_schnell_model_dir)
    assert not model.guidance_embeds and not model.pipeline.transformer.config.guidance_embeds
    forwards = _record_forward_kwargs(model.pipeline.transformer)
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["a red cube", "a blue ball"], ["blurry", ""])
    negative_as_positive = TensorDict(
        {
            "prompt_embeds": cond["negative_prompt_embeds"],
            "pooled_prompt_embeds": cond["negative_pooled_prompt_embeds"],
        },
        [2],
    )
    with torch.no_grad():
        guided = model.velocity(x, 0.7, cond, 3.0)
        v_cond = model.velocity(x, 0.7, cond, 1.0)
        v_uncond = model.velocity(x, 0.7, negative_as_positive, 1.0)
    assert forwards[0]["hidden_states"].shape[0] == 4 and forwards[0]["guidance"] is None  # one [uncond; cond] pass
    assert forwards[1]["hidden_states"].shape[0] == 2
    assert torch.allclose(guided, v_uncond + 3.0 * (v_cond - v_uncond), atol=1e-5)


def test_latent_shape_is_the_packed_token_grid(flux_model_dir, load):
    model = load(flux_model_dir)
    assert model.latent_shape(64, 32) == (8, 4, 16)  # 4× VAE, 2×2 packing, 4 latent channels
    with pytest.raises(ValueError, match="multiples of 8"):
        model.latent_shape(36, 32)


def test_decode_unpacks_and_undoes_the_vae_scaling(flux_model_dir, load):
    model = load(flux_model_dir)
    vae = model.pipeline.vae
    latents = torch.randn(1, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    z = latents.reshape(1, 4, 4, 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(1, 4, 8, 8)  # unpacked by hand
    with torch.no_grad():
        pixels = vae.decode(z / 0.3611 + 0.1159, return_dict=False)[0]
    expected = ((pixels / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(model.decode(latents), expected)
    assert model.encode(model.decode(latents)).shape == latents.shape
