"""Z-Image(-Turbo): the tiny model round trip, our ODE against ZImagePipeline's own loop, t = 1 − σ and the velocity's
sign, text padding, LoRA export through diffusers' load_lora_weights, init-tiny and doctor."""

from __future__ import annotations

import json

import pytest
import torch

from diffusion_rl.cli import main
from diffusion_rl.models.tiny import build_tiny
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, initial_noise, rollout


def test_saved_tiny_z_image_loads_back_bit_identical(z_image_model_dir):
    from diffusers import ZImagePipeline

    built = build_tiny("z_image", "small", seed=0)
    loaded = ZImagePipeline.from_pretrained(z_image_model_dir)
    for name in ("transformer", "vae", "text_encoder"):
        expected, actual = getattr(built, name).state_dict(), getattr(loaded, name).state_dict()
        assert expected.keys() == actual.keys(), name
        assert all(torch.equal(actual[k], v) for k, v in expected.items()), name
    message = [{"role": "user", "content": "A red cube, on a blue Table! 42 café"}]
    text = loaded.tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True,
                                                enable_thinking=True)  # fmt: skip
    assert text == "<|im_start|>user\nA red cube, on a blue Table! 42 café<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.tokenizer(text).input_ids == built.tokenizer(text).input_ids
    assert json.loads((z_image_model_dir / "model_index.json").read_text())["_class_name"] == "ZImagePipeline"


# 48 px: 12 × 12 = 144 image tokens, which the transformer pads to a multiple of 32 (SEQ_MULTI_OF) with its
# x_pad_token, as it does a real 1280 × 720 image's 3600; 32 px (8 × 8 = 64 tokens) and 1024² need no padding
@pytest.mark.parametrize(
    "guidance, size", [(1.0, 32), (3.0, 32), (3.0, 48)], ids=["turbo_cfg_free", "cfg", "cfg_padded_image_tokens"]
)
def test_our_ode_reproduces_the_pipelines_own_sampling_for_the_same_noise(z_image_model_dir, load, guidance, size):
    """Same noise, same prompts: our Euler ODE over the family's σ schedule gives ZImagePipeline's latents (fp32,
    atol 1e-5: the same operations in the same order, up to batching) and its images (at most 1 level of 255)."""
    model = load(z_image_model_dir)
    settings = SamplerSettings(num_steps=4, guidance=guidance, height=size, width=size)
    prompts, negative = ["a red cube", "a lighthouse at dusk on a cliff"], ["", "blurry"]
    noise = initial_noise(model, settings, [3, 4])
    cond = model.encode_prompts(prompts, negative)
    traj = rollout(model, cond, settings, None, init_seeds=[3, 4], noise_seeds=[3, 4], ids=anonymous_ids(prompts))
    pipe = model.pipeline
    # the pipeline's guidance_scale g gives c + g(c − u): ours s = g + 1; g = 0 is Turbo's CFG-free sampling
    kwargs = dict(height=size, width=size, num_inference_steps=4, guidance_scale=guidance - 1.0, max_sequence_length=16)
    # fresh lists each call: the pipeline writes the chat-templated prompts back into the list it is given
    latents = pipe(list(prompts), negative_prompt=list(negative), latents=noise.clone(), output_type="latent",
                   **kwargs).images  # fmt: skip
    assert torch.allclose(traj.final_latents, latents, atol=1e-5)
    images = pipe(list(prompts), negative_prompt=list(negative), latents=noise.clone(), output_type="np", **kwargs)
    images = torch.from_numpy(images.images)
    ours = traj.images.float() / 255
    assert (ours - images).abs().max() <= 1 / 255 + 1e-6
    assert (latents - noise).abs().mean() > 0.1  # the 4 steps moved the latents


def test_the_transformer_sees_one_minus_sigma_and_the_velocity_is_minus_its_output(z_image_model_dir, load):
    model = load(z_image_model_dir)
    seen = []
    model.pipeline.transformer.t_embedder.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["a red cube", "a blue ball"])
    with torch.no_grad():
        v = model.velocity(x, 0.7, cond, 1.0)
        rows = [cond["prompt_embeds"][i][cond["prompt_embeds_mask"][i]] for i in range(2)]
        out = model.pipeline.transformer(list(x[:, :, None]), torch.full((2,), 0.3), rows, return_dict=False)[0]
    assert torch.allclose(seen[0], torch.full((2,), 300.0))  # t_scale 1000 × (1 − σ)
    assert torch.allclose(v, -torch.stack(out)[:, :, 0], atol=1e-6)
    assert v.shape == x.shape and v.dtype == torch.float32


def test_text_padding_and_batch_neighbours_do_not_change_a_prompts_velocity(z_image_model_dir, load):
    model = load(z_image_model_dir)
    x = torch.randn(1, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    short = model.encode_prompts(["a cat"], [""])
    assert short["prompt_embeds"].shape[1] == model.max_sequence_length == 16
    assert 0 < short["prompt_embeds_mask"].sum() < 16 and not short["prompt_embeds_mask"][0, -1]
    rows, _ = model.pipeline.encode_prompt(["a cat"], do_classifier_free_guidance=False, max_sequence_length=16)
    assert torch.equal(short["prompt_embeds"][0][short["prompt_embeds_mask"][0]], rows[0])
    both = model.encode_prompts(["a cat", "a lighthouse at dusk above a stormy sea with gulls"], ["", ""])
    assert both["prompt_embeds_mask"][1].all()  # the long prompt is cut at max_sequence_length, as the pipeline does
    with torch.no_grad():
        alone = model.velocity(x, 0.6, short, 4.0)
        in_batch = model.velocity(torch.cat([x, x]), 0.6, both, 4.0)[:1]
    assert torch.allclose(alone, in_batch, atol=1e-5)


def test_lora_adapter_loads_with_diffusers_and_gives_identical_images(z_image_model_dir, load, train_model, tmp_path):
    overrides = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "train.total_steps=1"]
    trainer = train_model(z_image_model_dir, f"run.dir={tmp_path / 'run'}", *overrides, "train.lr=1e-2")
    trainer.train()
    trained = trainer.engine.model
    adapter = tmp_path / "run" / "checkpoints" / "step_000001" / "adapter"
    settings = SamplerSettings(num_steps=3, guidance=1.0, height=32, width=32)
    prompts = ["a red cube", "a blue ball"]

    def sample(model):
        cond = model.encode_prompts(prompts)
        traj = rollout(model, cond, settings, None, init_seeds=[0, 1], noise_seeds=[0, 1], ids=anonymous_ids(prompts))
        return traj.final_latents, traj.images

    fresh = load(z_image_model_dir)
    base, _ = sample(fresh)
    fresh.pipeline.load_lora_weights(adapter)  # diffusers' own loader, alpha/rank from the file's metadata
    (latents, images), (trained_latents, trained_images) = sample(fresh), sample(trained)
    assert (trained_latents - base).abs().max() > 1e-4  # the step moved the policy
    assert torch.equal(latents, trained_latents) and torch.equal(images, trained_images)  # difference 0


def test_init_tiny_and_doctor(tmp_path, capsys):
    model_dir = tmp_path / "model"
    assert main(["init-tiny", str(model_dir), "--family", "z_image", "--preset", "small"]) == 0
    assert json.loads((model_dir / "model_index.json").read_text())["_class_name"] == "ZImagePipeline"
    out = tmp_path / "doctor.png"
    argv = ["doctor", "--model", str(model_dir), "--dtype", "fp32", "--device", "cpu", "--height", "32"]
    argv += ["--width", "32", "--steps", "2", "--micro-batch", "2", "--max-sequence-length", "16", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "family     z_image" in text
    for component in ("transformer", "vae", "text_encoder"):
        assert f"  {component} " in text
    assert "trainable" in text and "activations (micro-batch)" in text
    assert out.is_file() and out.stat().st_size > 0


def test_sigma_schedule_is_the_pipelines_shift_3_grid(z_image_model_dir, load):
    model = load(z_image_model_dir)
    by_hand = torch.tensor([3 * u / (1 + 2 * u) for u in (1 - k / 8 for k in range(8))] + [0.0])
    assert torch.allclose(model.sigma_schedule(8, 32, 32), by_hand, atol=1e-6)
    assert torch.equal(model.sigma_schedule(8, 32, 32), model.sigma_schedule(8, 1024, 1024))  # no dynamic shift


def test_lora_preset_adapts_attention_and_feed_forward_of_every_block_only(z_image_model_dir, load):
    model = load(z_image_model_dir, lora=True)
    trained = {n for n, p in model.policies.trained.named_parameters() if p.requires_grad}
    for block in ("noise_refiner.0", "context_refiner.0", "layers.0"):
        for part in ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):  # fmt: skip
            assert any(f"{block}.{part}.lora_A" in n for n in trained), f"{block}.{part}"
    frozen = ("all_x_embedder", "all_final_layer", "cap_embedder", "t_embedder", "adaLN_modulation")
    assert not any(part in n for n in trained for part in frozen)


def test_text_longer_than_the_ropes_first_axis_holds_is_refused_at_load(z_image_model_dir, load):
    """The caption (padded to a multiple of 32) and then the image share the RoPE's first axis of axes_lens[0]
    positions: the tiny's 512 hold 480 caption tokens, not 481 (the transformer itself fails there), and Z-Image's
    1536 hold 1504 (assets/architectures/Z-Image-Turbo.json)."""
    from diffusion_rl.errors import UserError
    from diffusion_rl.estimate.architectures import from_shipped
    from diffusion_rl.models.families.z_image import max_text_tokens

    model = load(z_image_model_dir, max_sequence_length=480)
    transformer = model.pipeline.transformer
    assert transformer.config.axes_lens[0] == 512 and max_text_tokens(transformer.config) == 480
    latents = [torch.zeros(4, 1, 16, 16)]
    with torch.no_grad():
        transformer(latents, torch.ones(1), [torch.zeros(480, 32)], return_dict=False)
        with pytest.raises(IndexError):
            transformer(latents, torch.ones(1), [torch.zeros(481, 32)], return_dict=False)
    with pytest.raises(UserError, match="max_sequence_length: at most 480 .* got 481"):
        load(z_image_model_dir, max_sequence_length=481)
    assert max_text_tokens(from_shipped("Z-Image-Turbo").transformer_config) == 1504
