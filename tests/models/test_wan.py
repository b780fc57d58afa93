"""Wan text-to-video: the tiny model round trip, video latents, the σ schedule, CFG and decoding as the pipeline
does them, and what the adapter refuses."""

from __future__ import annotations

import json

import pytest
import torch

from diffusion_rl.models.tiny import build_tiny


@pytest.mark.parametrize("preset", ["small", "ti2v"])
def test_saved_tiny_wan_loads_back_bit_identical(family_dirs, preset):
    from diffusers import WanPipeline

    path = family_dirs["wan" if preset == "small" else "wan_ti2v"]
    built, loaded = build_tiny("wan", preset, seed=0), WanPipeline.from_pretrained(path)
    for name in ("transformer", "vae", "text_encoder"):
        expected, actual = getattr(built, name).state_dict(), getattr(loaded, name).state_dict()
        assert expected.keys() == actual.keys(), name
        assert all(torch.equal(actual[k], v) for k, v in expected.items()), name
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
    assert loaded.config.expand_timesteps is (preset == "ti2v")


def test_video_latents_have_the_vae_layout_and_sizes_are_checked(family_dirs, load):
    model = load(family_dirs["wan"])
    assert model.video and (model.vae_scale, model.temporal_scale) == (4, 4)
    # 9 frames: the first, then 8 folded 4 to a latent frame → 3; 32 px / 4 = 8
    assert model.latent_shape(32, 48, 9) == (4, 3, 8, 12)
    assert model.latent_shape(32, 32, 1) == (4, 1, 8, 8)
    with pytest.raises(ValueError, match=r"frames must be 4·k \+ 1"):
        model.latent_shape(32, 32, 8)
    with pytest.raises(ValueError, match="multiples of 8"):
        model.latent_shape(36, 32, 9)  # VAE 4× then the transformer's 2×2 patches
    ti2v = load(family_dirs["wan_ti2v"])  # Wan 2.2's VAE folds 2×2 pixels first: 8× in space
    assert ti2v.latent_shape(32, 32, 5) == (4, 2, 4, 4)


def test_sigma_schedule_is_the_checkpoints_unipc_flow_sigma_points(family_dirs, load):
    model = load(family_dirs["wan"])
    shift = 3.0  # the tiny Wan 2.1's flow_shift, as Wan2.1-T2V-1.3B's
    assert model.shift == shift

    def shifted(s):  # shifted once
        return shift * s / (1 + (shift - 1) * s)

    # UniPC's flow sigmas: 5 times evenly spaced from 1 to 1/1000, the last dropped, shifted, then 0
    expected = [shifted(1 - i * 0.999 / 4) for i in range(4)] + [0.0]
    assert model.sigma_schedule(4, 32, 32, 9).tolist() == pytest.approx(expected, abs=1e-6)
    # 10 steps by hand: u_9 = 1 − 9·0.999/10 = 0.1009, σ_9 = 0.3027 / 1.2018 = 0.25187 (the flow-matching Euler
    # scheduler's shift-3 grid, shifted twice, ends at 0.0089: a last step all but wasted)
    assert float(model.sigma_schedule(10, 32, 32, 9)[9]) == pytest.approx(0.3027 / 1.2018, abs=1e-6)
    ti2v = load(family_dirs["wan_ti2v"])
    assert ti2v.shift == 5.0
    # shift 5, 4 steps: u = 1, 0.75025, 0.5005, 0.25075 → 1, 0.93758, 0.83361, 0.62594, 0
    assert ti2v.sigma_schedule(4, 32, 32, 5).tolist() == pytest.approx([1, 0.93758, 0.83361, 0.62594, 0], abs=1e-5)


@pytest.mark.parametrize("steps, shift", [(1, 3.0), (4, 5.0), (10, 3.0), (20, 3.0), (20, 12.0), (20, 16.0), (7, 1.0)])
def test_wan_sigma_points_are_diffusers_unipc_flow_sigmas(steps, shift):
    """UniPCMultistepScheduler as the Wan checkpoints configure it, bit for bit but for σ_0, which UniPC lowers to
    1 − 1e-6 (its multistep update takes log(1 − σ)); ours starts at 1."""
    from diffusers import UniPCMultistepScheduler

    from diffusion_rl.models.families.wan import unipc_flow_sigmas

    scheduler = UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=shift, prediction_type="flow_prediction",
                                        final_sigmas_type="zero", num_train_timesteps=1000)  # fmt: skip
    scheduler.set_timesteps(steps)
    ours = unipc_flow_sigmas(steps, shift, 1000).float()
    assert ours.shape == scheduler.sigmas.shape and float(ours[0]) == 1.0 and float(ours[-1]) == 0.0
    assert torch.equal(ours[1:], scheduler.sigmas[1:])
    assert float(scheduler.sigmas[0]) == pytest.approx(1 - 1e-6, abs=1e-7)


def test_guided_velocity_is_cfg_of_two_forwards_at_timestep_1000_sigma(family_dirs, load):
    model = load(family_dirs["wan"])
    cond = model.encode_prompts(["a red ball bouncing", "a cat"], ["blurry", ""])
    x = torch.randn(2, *model.latent_shape(32, 32, 5), generator=torch.Generator().manual_seed(0))
    transformer = model.pipeline.transformer
    with torch.no_grad():
        v = model.velocity(x, 0.6, cond, 5.0)
        t = torch.full((2,), 600.0)
        v_pos = transformer(hidden_states=x, timestep=t, encoder_hidden_states=cond["prompt_embeds"])[0]
        v_neg = transformer(hidden_states=x, timestep=t, encoder_hidden_states=cond["negative_prompt_embeds"])[0]
    assert v.shape == x.shape and v.dtype == torch.float32
    assert torch.allclose(v, v_neg + 5.0 * (v_pos - v_neg), atol=1e-5)
    # the embeddings are the pipeline's: padded to max_sequence_length with zeros
    embeds, _ = model.pipeline.encode_prompt(["a cat"], do_classifier_free_guidance=False, max_sequence_length=16)
    assert torch.equal(cond["prompt_embeds"][1], embeds[0])


def test_ti2v_per_token_timesteps_equal_one_timestep_per_sample_in_text_to_video(family_dirs, load):
    model = load(family_dirs["wan_ti2v"])
    cond = model.encode_prompts(["a red ball"])
    x = torch.randn(1, *model.latent_shape(32, 32, 5), generator=torch.Generator().manual_seed(1))
    tokens = x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2)  # frames × rows × columns after the 2×2 patches
    with torch.no_grad():
        per_token = model.pipeline.transformer(
            hidden_states=x, timestep=torch.full((1, tokens), 700.0), encoder_hidden_states=cond["prompt_embeds"]
        )[0]
        assert torch.allclose(model.velocity(x, 0.7, cond, 1.0), per_token, atol=1e-5)


def test_decode_gives_the_pipelines_frames_as_uint8_videos(family_dirs, load):
    model = load(family_dirs["wan"])
    z = torch.randn(2, *model.latent_shape(32, 32, 5), generator=torch.Generator().manual_seed(2))
    videos = model.decode(z)
    assert videos.shape == (2, 5, 32, 32, 3) and videos.dtype == torch.uint8
    vae, config = model.pipeline.vae, model.pipeline.vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():  # what WanPipeline does after its loop, output_type="np"
        frames = model.pipeline.video_processor.postprocess_video(vae.decode(z / inv_std + mean)[0], output_type="np")
    assert (videos.float() - torch.from_numpy(frames * 255).round()).abs().max() <= 1
    assert model.encode(videos).shape == z.shape  # the inverse direction (offline data), the VAE's mode
