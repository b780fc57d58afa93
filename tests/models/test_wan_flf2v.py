"""Wan first-and-last-frame video (Wan2.1-FLF2V, and Wan 2.2 I2V-A14B with a last frame): the tiny FLF2V model in the
real layout, the condition video and its mask as WanImageToVideoPipeline(last_image=…) builds them, our sampler
against the pipeline for the same noise, what each checkpoint refuses, and the image tokens `estimate` counts."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_rl.errors import UserError
from diffusion_rl.models.tiny import save_tiny
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, initial_noise, rollout
from tests.helpers import euler_on

PROMPTS = ["the circle rolls left", "a square falls"]
FRAMES = np.random.default_rng(0).integers(0, 256, (2, 2, 32, 32, 3), dtype=np.uint8)  # [row, first/last, H, W, 3]
ROWS = [list(row) for row in FRAMES]


@pytest.fixture(scope="module")
def i2v_a14b_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_wan_i2v_a14b"), "wan_i2v", "a14b", seed=0)


def test_the_tiny_flf2v_is_laid_out_as_the_real_checkpoint_and_loads_as_wan_i2v(wan_flf2v_model_dir, load):
    config = json.loads((wan_flf2v_model_dir / "transformer" / "config.json").read_text())
    # as Wan2.1-FLF2V-14B-720P-diffusers: 2 × the CLIP encoder's tokens ((32 / 8)² patches + the class token)
    assert config["pos_embed_seq_len"] == 2 * 17 and config["image_dim"] == 16 and config["in_channels"] == 12
    model = load(wan_flf2v_model_dir)
    assert model.family == "wan_i2v" and model.frames_given == (2,)
    assert model.pipeline.transformer.condition_embedder.image_embedder.pos_embed.abs().min() > 0  # drawn, not zeros


def test_the_video_condition_with_a_last_frame_is_the_pipelines(wan_flf2v_model_dir, load):
    model = load(wan_flf2v_model_dir)
    pipe = model.pipeline
    first, last = (pipe.video_processor.preprocess(Image.fromarray(f), height=32, width=32) for f in FRAMES[0])
    with torch.no_grad():
        _, expected = pipe.prepare_latents(first, 1, 4, 32, 32, 9, torch.float32, torch.device("cpu"), last_image=last)
    condition = model.video_condition(torch.from_numpy(FRAMES[:1]), 3)
    assert condition.shape == expected.shape == (1, 4 + 4, 3, 8, 8)
    assert torch.equal(condition[:, :4], expected[:, :4])
    # the mask: 1 on the first latent frame, and on the last pixel frame (the last latent frame's last channel)
    given = torch.zeros(4, 3)
    given[:, 0], given[3, 2] = 1, 1
    assert torch.equal(condition[0, :4, :, 0, 0], given) and condition[:, :4].amax((-1, -2)).eq(given).all()
    assert (condition - expected).abs().max() <= 1e-5  # [-1, 1] pixels by /127.5 − 1 here, by /255·2 − 1 there
    with pytest.raises(UserError, match="sampling.num_frames: a first and a last frame need at least 5 frames, got 1"):
        model.video_condition(torch.from_numpy(FRAMES[:1]), 1)


def _pipeline_latents(model, noise, guidance: float, text_tokens: int, rows=FRAMES) -> torch.Tensor:
    """WanImageToVideoPipeline(last_image=…)'s own sampling of PROMPTS (negative: "") from our initial noise and our σ
    grid, its text encoded by itself at `text_tokens`, one row per call (the pipeline takes one image pair a call)."""
    pipe = model.pipeline
    pipe.scheduler = euler_on(model.sigma_schedule(4, 32, 32, 5))  # diffusers' Euler steps on our (UniPC's) σ points
    videos = []
    for i, (first, last) in enumerate(rows):
        r = slice(i, i + 1)
        videos.append(pipe(image=Image.fromarray(first), last_image=Image.fromarray(last), prompt=PROMPTS[r],
                           negative_prompt="", latents=noise[r], height=32, width=32, num_frames=5,
                           num_inference_steps=4, guidance_scale=guidance, max_sequence_length=text_tokens,
                           output_type="latent").frames)  # fmt: skip
    return torch.cat(videos)


@pytest.mark.parametrize("variant", ["flf2v", "i2v_a14b"])
def test_ode_sampling_with_a_last_frame_equals_the_pipelines(wan_flf2v_model_dir, i2v_a14b_dir, load, variant,
                                                             i2v_pipeline_text):  # fmt: skip
    # ours at the tiny's 32 text tokens (the prompts have 19 and 13). FLF2V's transformer splits its context into image
    # and text tokens 512 from the end (diffusers' WanAttnProcessor): the pipeline routes the two images' tokens right
    # at its default max_sequence_length 512 only, whose text embeddings are ours zero-padded; A14B has no image tokens
    # and reads the text as encoded, the pipeline's at ours
    model = load(wan_flf2v_model_dir if variant == "flf2v" else i2v_a14b_dir, max_sequence_length=32)
    settings = SamplerSettings(num_steps=4, guidance=4.0, height=32, width=32, frames=5)

    def ours(rows):
        cond = model.encode_prompts(PROMPTS, ["", ""], rows)
        traj = rollout(model, cond, settings, None, init_seeds=[1, 2], noise_seeds=[1, 2], ids=anonymous_ids(PROMPTS))
        return cond, traj.final_latents

    cond, final = ours(ROWS)
    with torch.no_grad():
        noise = initial_noise(model, settings, [1, 2])
        expected = _pipeline_latents(model, noise, 4.0, 512 if variant == "flf2v" else 32)
    # the same operations but for the pixels' scaling and the timestep's rounding: 1e-5 (measured 2026-11-27 on AMD EPYC
    # without AMX: 1.6e-6 FLF2V, 2.3e-6 A14B; the pipeline at 32 tokens misroutes FLF2V's image tokens, 1.5 off;
    # exchanging first and last moves the video by 0.1-0.24)
    assert (final - expected).abs().max() <= 1e-5
    _, swapped = ours([row[::-1] for row in ROWS])  # last and first exchanged: another video
    assert (swapped - expected).abs().max() > 1e-2
    if variant == "flf2v":  # the CLIP tokens count too: the same condition video, the images' tokens exchanged
        cond["image_embeds"] = cond["image_embeds"].flip(1)
        traj = rollout(model, cond, settings, None, init_seeds=[1, 2], noise_seeds=[1, 2], ids=anonymous_ids(PROMPTS))
        assert (traj.final_latents - expected).abs().max() > 1e-2


def test_what_each_checkpoint_takes(wan_i2v_model_dir, wan_flf2v_model_dir, wan_ti2v_model_dir, i2v_a14b_dir, load):
    one, two, three = [row[:1] for row in ROWS], ROWS, [[*row, row[0]] for row in ROWS]
    flf2v = load(wan_flf2v_model_dir)
    with pytest.raises(UserError, match=r"needs 2 condition image\(s\), got 1 .*pos_embed_seq_len 34 in transformer"):
        flf2v.encode_prompts(PROMPTS, None, one)
    i2v = load(wan_i2v_model_dir)
    with pytest.raises(UserError, match=r"needs 1 condition image\(s\), got 2 .*no pos_embed_seq_len in transformer"):
        i2v.encode_prompts(PROMPTS, None, two)
    ti2v = load(wan_ti2v_model_dir, family="wan_i2v")
    with pytest.raises(UserError, match=r"needs 1 condition image\(s\), got 2 .*TI2V-5B \(expand_timesteps\)"):
        ti2v.encode_prompts(PROMPTS, None, two)
    a14b = load(i2v_a14b_dir)  # no CLIP tokens: the pipeline takes a last frame or none
    assert a14b.frames_given == (1, 2)
    with pytest.raises(UserError, match=r"needs 1 or 2 condition image\(s\), got 3"):
        a14b.encode_prompts(PROMPTS, None, three)
    for model, rows in ((flf2v, two), (i2v, one), (ti2v, one), (a14b, one), (a14b, two)):
        model.encode_prompts(PROMPTS, None, rows)  # what each takes


def test_estimate_counts_the_flf2v_checkpoints_514_image_tokens():
    """The shipped Wan2.1-FLF2V-14B-720P architecture: two images' 257 CLIP tokens per row, which its transformer
    reads as one sequence of 514; one call's FLOPs exceed Wan2.1-I2V-14B's (the same but for pos_embed_seq_len) by
    what 257 more image tokens cost, counted here by hand."""
    from diffusion_rl.estimate.architectures import from_shipped
    from diffusion_rl.estimate.counting import Shapes, build_on_meta, transformer_cost, transformer_inputs

    def one_block(name):  # of its 40, to keep this fast
        shipped = from_shipped(name)
        return dataclasses.replace(shipped, transformer_config={**shipped.transformer_config, "num_layers": 1})

    flf2v, i2v = one_block("Wan2.1-FLF2V-14B-720P-diffusers"), one_block("Wan2.1-I2V-14B-480P-Diffusers")
    assert flf2v.family == "wan_i2v"
    assert flf2v.transformer_config == {**i2v.transformer_config, "pos_embed_seq_len": 514}  # VAE, encoders the same
    shapes = Shapes(1, 720, 1280, 5, 512)  # 512 text tokens: the transformer splits image from text tokens there
    inputs = transformer_inputs(flf2v, shapes, torch.bfloat16)
    assert inputs["encoder_hidden_states_image"].shape == (2, 257, 1280)  # [first; last], one row
    module = build_on_meta(flf2v.transformer_class, flf2v.transformer_config)
    assert module.condition_embedder.image_embedder(inputs["encoder_hidden_states_image"]).shape == (1, 514, 5120)
    latent_tokens = 2 * (720 // 16) * (1280 // 16)  # 2 latent frames of 45 × 80 patches
    extra = 257
    embedder = 2 * 1280 * 1280 + 2 * 1280 * 5120  # the image embedder's feed-forward, per token
    per_block = 2 * 2 * 5120 * 5120 + 4 * latent_tokens * 5120  # add_k_proj, add_v_proj; scores and their average
    cost = {name: transformer_cost(arch, shapes, full_finetune=True) for name, arch in (("flf2v", flf2v), ("i2v", i2v))}
    assert cost["flf2v"].forward_flops - cost["i2v"].forward_flops == extra * (embedder + per_block)


def test_doctor_samples_the_flf2v_model_from_two_test_pictures(wan_flf2v_model_dir, tmp_path, capsys):
    from diffusion_rl.cli import main

    out = tmp_path / "doctor.png"
    argv = ["doctor", "--model", str(wan_flf2v_model_dir), "--dtype", "fp32", "--device", "cpu", "--height", "32",
            "--width", "32", "--frames", "5", "--steps", "2", "--micro-batch", "2", "--max-sequence-length", "16",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0  # no --image: a first and a last test picture, as the checkpoint takes only two
    assert "2 condition image(s)" in capsys.readouterr().out and out.with_suffix(".webp").is_file()
