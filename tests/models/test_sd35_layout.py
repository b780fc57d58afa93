"""The tiny SD3 laid out as stable-diffusion-3.5-medium (`sd35`: dual-attention blocks, RMS q/k norms, the VAE's
latent factors 1.5305 / 0.0609 without quant convs), paths the other tiny SD3 presets never take: our ODE against
StableDiffusion3Pipeline's own sampling, and which attention the LoRA preset adapts."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, initial_noise, rollout


@pytest.fixture(scope="module")
def sd35_dir(tmp_path_factory):
    from diffusion_rl.models.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny_sd35"), "sd3", "sd35", seed=0)


def test_the_preset_has_the_real_layout(sd35_dir, load):
    model = load(sd35_dir)
    transformer, vae = model.pipeline.transformer, model.vae
    assert transformer.config.dual_attention_layers == [0] and transformer.config.qk_norm == "rms_norm"
    assert transformer.transformer_blocks[0].attn2 is not None and transformer.transformer_blocks[1].attn2 is None
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (1.5305, 0.0609)
    assert vae.quant_conv is None and vae.post_quant_conv is None


def test_our_ode_reproduces_the_pipelines_own_sampling_for_the_same_noise(sd35_dir, load):
    """Same noise, same prompts, CFG 4.5: our Euler ODE gives StableDiffusion3Pipeline's latents (fp32, atol 1e-5:
    the same operations in the same order) and its images (at most 1 level of 255: the VAE's factors undone)."""
    model = load(sd35_dir)
    settings = SamplerSettings(num_steps=4, guidance=4.5, height=32, width=32)
    prompts, negative = ["a red cube", "a lighthouse at dusk on a cliff"], ["", "blurry"]
    noise = initial_noise(model, settings, [3, 4])
    cond = model.encode_prompts(prompts, negative)
    traj = rollout(model, cond, settings, None, init_seeds=[3, 4], noise_seeds=[3, 4], ids=anonymous_ids(prompts))
    kwargs = dict(prompt=prompts, negative_prompt=negative, height=32, width=32, num_inference_steps=4,
                  guidance_scale=4.5, max_sequence_length=model.max_sequence_length)  # fmt: skip
    latents = model.pipeline(latents=noise.clone(), output_type="latent", **kwargs).images
    assert (traj.final_latents - latents).abs().max() <= 1e-5
    images = torch.from_numpy(model.pipeline(latents=noise.clone(), output_type="np", **kwargs).images)
    assert (traj.images.float() / 255 - images).abs().max() <= 1 / 255 + 1e-6
    assert (latents - noise).abs().mean() > 0.1  # the 4 steps moved the latents


def test_lora_preset_adapts_the_joint_attention_not_the_second_image_attention(sd35_dir, load):
    """flow_grpo's SD3 targets (`attn.to_q`, …) name the joint attention only: SD3.5-Medium's second, image-only
    attention (`attn2`) of its dual-attention blocks stays frozen, as in flow_grpo's SD3.5-M runs."""
    model = load(sd35_dir, lora=True)
    names = [name for name, _ in model.policies.module.named_modules() if name.endswith("lora_A")]
    assert any(".attn.to_q." in name for name in names) and any(".attn.to_add_out." in name for name in names)
    assert not any(".attn2." in name for name in names)
