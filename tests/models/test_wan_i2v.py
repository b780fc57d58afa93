"""Wan image-to-video: the tiny model in the real layout, the first frame's conditioning as WanImageToVideoPipeline
builds it, our sampler against the pipeline for the same noise (Wan 2.1 I2V and Wan 2.2 TI2V), what the adapter
refuses, LoRA export to diffusers, doctor and estimate."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_rl.cli import main
from diffusion_rl.errors import UserError
from diffusion_rl.estimate.architectures import from_shipped
from diffusion_rl.models.tiny import build_tiny
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, initial_noise, rollout
from diffusion_rl.sampling.window import SdeWindow
from tests.helpers import euler_on

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["the circle rolls left", "a square falls"]
FIRST = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)  # one first frame per row
ROWS = [[FIRST[0]], [FIRST[1]]]


def one_block(name: str, family: str = "auto"):
    """A shipped architecture with one of its 40 blocks, to keep estimate fast (the counting is tested in
    tests/test_estimate.py)."""
    shipped = from_shipped(name, family)
    return dataclasses.replace(shipped, transformer_config={**shipped.transformer_config, "num_layers": 1})


@pytest.fixture
def weights_of():
    return lambda trainer: trainer.engine.model.policies.trainable_state_dict()  # detached copies


def test_init_tiny_writes_a_wan21_i2v_that_loads_back_bit_identical(tmp_path, load):
    assert main(["init-tiny", str(tmp_path / "m"), "--family", "wan_i2v", "--preset", "small"]) == 0
    index = json.loads((tmp_path / "m" / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline" and index["expand_timesteps"] is False
    assert index["image_encoder"] == ["transformers", "CLIPVisionModel"]
    assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]  # as the real checkpoint names it
    model, built = load(tmp_path / "m"), build_tiny("wan_i2v", "small", seed=0)
    assert model.family == "wan_i2v" and model.edits and model.video
    for name in ("transformer", "vae", "text_encoder", "image_encoder"):
        expected, actual = getattr(built, name).state_dict(), getattr(model.pipeline, name).state_dict()
        assert expected.keys() == actual.keys(), name
        assert all(torch.equal(actual[k], v) for k, v in expected.items()), name
    config = model.pipeline.transformer.config
    assert (config.in_channels, config.out_channels, config.image_dim) == (2 * 4 + 4, 4, 16)  # 2·C + mask, CLIP
    assert model.latent_shape(32, 32, 5) == (4, 2, 8, 8)  # the generated latents alone


def test_the_video_condition_is_the_pipelines_mask_and_first_frame_latents(wan_i2v_model_dir, load):
    model = load(wan_i2v_model_dir)
    pipe = model.pipeline
    image = pipe.video_processor.preprocess(Image.fromarray(FIRST[0]), height=32, width=32)  # [1, 3, 32, 32]
    with torch.no_grad():
        _, expected = pipe.prepare_latents(image, 1, 4, 32, 32, 9, torch.float32, torch.device("cpu"))
    condition = model.video_condition(torch.from_numpy(FIRST[:1, None]), 3)
    assert condition.shape == expected.shape == (1, 4 + 4, 3, 8, 8)
    assert torch.equal(condition[:, :4], expected[:, :4])  # the mask: 1 on the first latent frame only
    assert condition[:, :4, 0].eq(1).all() and condition[:, :4, 1:].eq(0).all()
    assert (condition - expected).abs().max() <= 1e-5  # [-1, 1] pixels by /127.5 − 1 here, by /255·2 − 1 there
    # kept between calls, and a shorter video's condition is a prefix (the VAE encodes causally, chunk by chunk)
    assert torch.equal(model.video_condition(torch.from_numpy(FIRST[:1, None]), 3), condition)
    assert torch.equal(model.video_condition(torch.from_numpy(FIRST[:1, None]), 2), condition[:, :, :2])


def _pipeline_latents(model, noise, guidance: float, text_tokens: int) -> torch.Tensor:
    """WanImageToVideoPipeline's own sampling of PROMPTS (negative: "") from our initial noise with diffusers'
    flow-matching Euler scheduler on our σ points (UniPC's), its text encoded by itself at `text_tokens`."""
    pipe = model.pipeline
    pipe.scheduler = euler_on(model.sigma_schedule(4, 32, 32, 5))
    rows = [slice(i, i + 1) for i in range(len(FIRST))]  # the pipeline takes one image per call
    return torch.cat([pipe(image=Image.fromarray(FIRST[r][0]), prompt=PROMPTS[r], negative_prompt="", latents=noise[r],
                           height=32, width=32, num_frames=5, num_inference_steps=4, guidance_scale=guidance,
                           max_sequence_length=text_tokens, output_type="latent").frames for r in rows])  # fmt: skip


@pytest.mark.parametrize("variant", ["wan21_i2v", "wan22_ti2v"])
def test_ode_sampling_equals_the_pipelines_for_the_same_noise(wan_i2v_model_dir, wan_ti2v_model_dir, load, variant,
                                                              i2v_pipeline_text):  # fmt: skip
    """Ours at the tiny's 32 text tokens (the prompts have 19 and 13). Wan 2.1 I2V's transformer splits its context
    into image and text tokens 512 from the end (diffusers' WanAttnProcessor): the pipeline routes the image tokens
    right at its default max_sequence_length 512 only, whose text embeddings are ours zero-padded; TI2V reads the text
    as encoded, the pipeline's at ours."""
    path = wan_i2v_model_dir if variant == "wan21_i2v" else wan_ti2v_model_dir
    model = load(path, family="wan_i2v", max_sequence_length=32)  # TI2V-5B's checkpoint is a WanPipeline: named
    guidance = 4.0
    settings = SamplerSettings(num_steps=4, guidance=guidance, height=32, width=32, frames=5)
    cond = model.encode_prompts(PROMPTS, ["", ""], ROWS)
    traj = rollout(model, cond, settings, None, init_seeds=[1, 2], noise_seeds=[1, 2], ids=anonymous_ids(PROMPTS))
    with torch.no_grad():
        expected = _pipeline_latents(model, initial_noise(model, settings, [1, 2]), guidance,
                                     512 if variant == "wan21_i2v" else 32)  # fmt: skip
    # the same operations but for the pixels' scaling and the timestep's rounding: 1e-5 (I2V measured 1.9e-6 on AMD EPYC
    # without AMX, 1.6 off against the pipeline at 32 tokens; TI2V's first frame, 1e-4: our path to the condition
    # against the pipeline's replacement at the end)
    assert (traj.final_latents - expected).abs().max() <= (1e-5 if variant == "wan21_i2v" else 1e-4)
    if variant == "wan22_ti2v":
        assert model.replaces_first_frame and "image_latents" in cond.keys()  # noqa: SIM118  (TensorDict refuses `in`)
        assert torch.allclose(traj.final_latents[:, :, :1], cond["image_latents"][:, 0], atol=1e-5)


def test_the_image_tokens_reach_the_image_cross_attention_at_a_short_text_length(wan_i2v_model_dir, load):
    """16 text tokens are stored; the transformer gets them zero-padded to 512 after the 17 CLIP tokens, both halves of
    CFG, so its image cross-attention (add_k_proj, add_v_proj) reads those tokens: zeroing its value projection
    changes the velocity, and so does another image's tokens."""
    model = load(wan_i2v_model_dir)
    calls = []
    model.pipeline.transformer.register_forward_pre_hook(lambda _, a, kw: calls.append(kw), with_kwargs=True)
    cond = model.encode_prompts(PROMPTS, ["", ""], ROWS)
    assert cond["prompt_embeds"].shape[1] == cond["negative_prompt_embeds"].shape[1] == 16  # stored as encoded
    x = torch.randn(2, *model.latent_shape(32, 32, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = model.velocity(x, 0.6, cond, 4.0)
        text = calls[0]["encoder_hidden_states"]
        assert text.shape == (4, 512, cond["prompt_embeds"].shape[2])  # [negative; positive]: 16 tokens, zeros
        assert torch.equal(text[:, :16], torch.cat([cond["negative_prompt_embeds"], cond["prompt_embeds"]]))
        assert text[:, 16:].eq(0).all()
        other = cond.clone()
        other["image_embeds"] = cond["image_embeds"].flip(0)  # the rows' images' tokens exchanged
        assert (model.velocity(x, 0.6, other, 4.0) - v).abs().max() > 1e-3
        attention = [m for m in model.pipeline.transformer.modules() if getattr(m, "add_v_proj", None) is not None]
        assert attention
        for m in attention:
            m.add_v_proj.weight.zero_()
            m.add_v_proj.bias.zero_()
        assert (model.velocity(x, 0.6, cond, 4.0) - v).abs().max() > 1e-3


def test_ti2v_gives_the_first_frame_timestep_zero_and_a_weight_free_velocity(wan_ti2v_model_dir, load):
    model = load(wan_ti2v_model_dir, family="wan_i2v")
    calls = []
    model.pipeline.transformer.register_forward_pre_hook(lambda _, a, kw: calls.append(kw), with_kwargs=True)
    cond = model.encode_prompts(PROMPTS, None, ROWS)
    x = torch.randn(2, *model.latent_shape(32, 32, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = model.velocity(x, 0.6, cond, 1.0)
    c = cond["image_latents"][:, 0]
    timestep, hidden = calls[0]["timestep"], calls[0]["hidden_states"]
    assert timestep.shape == (2, 2 * 2 * 2)  # 2 latent frames × (4 / 2)² tokens: the first frame's 4 at 0
    assert timestep[:, :4].eq(0).all() and torch.allclose(timestep[:, 4:], torch.tensor(600.0))
    assert torch.equal(hidden[:, :, :1], c) and torch.equal(hidden[:, :, 1:], x[:, :, 1:])
    assert torch.allclose(v[:, :, :1], (x[:, :, :1] - c) / 0.6)  # clean estimate x − σ·v is the condition


def test_ti2v_first_frame_latents_are_the_pipelines_fp32_ones_in_a_bf16_model(wan_ti2v_model_dir, load):
    """WanImageToVideoPipeline normalises the first frame's VAE latents in fp32 and puts them, fp32, in the finished
    video's first latent frame: a bf16 model must not round them to bf16 (the sampled video's first frame ends
    at them)."""
    from diffusers import WanImageToVideoPipeline

    model = load(wan_ti2v_model_dir, family="wan_i2v", dtype="bf16")
    pipe = model.pipeline
    image = pipe.video_processor.preprocess(Image.fromarray(FIRST[0]), height=32, width=32)
    with torch.no_grad():  # its VAE in bf16, as ours; the condition normalised in the latents' dtype, fp32
        _, expected, _ = WanImageToVideoPipeline.prepare_latents(pipe, image, 1, 4, 32, 32, 5, torch.float32,
                                                                 torch.device("cpu"))  # fmt: skip
    cond = model.encode_prompts(PROMPTS[:1], None, ROWS[:1])
    c = cond["image_latents"][:, 0]
    assert c.shape == expected.shape == (1, 4, 1, 4, 4) and expected.dtype == torch.float32
    assert torch.equal(c.float(), expected)  # the same bf16 VAE output, normalised and kept in fp32
    settings = SamplerSettings(num_steps=4, guidance=1.0, height=32, width=32, frames=5)
    final = rollout(model, cond, settings, None, init_seeds=[1], noise_seeds=[1],
                    ids=anonymous_ids(PROMPTS[:1])).final_latents  # fmt: skip
    assert (final[:, :, :1] - expected).abs().max() <= 1e-5  # the straight path ends at c (fp32 rounding)


@pytest.mark.parametrize("sde_type", ["sde", "dance_sde"])
def test_ti2v_videos_start_at_the_given_frame_when_the_last_step_is_stochastic(wan_ti2v_model_dir, load, sde_type):
    """A window through the last step (sampling.window.hi = num_steps) draws noise into the first latent frame too:
    the video must still end at the given frame's latents, as the pipeline's (it puts them back after its loop), and
    the window's stored latents stay the drawn ones the update replays."""
    model = load(wan_ti2v_model_dir, family="wan_i2v")
    cond = model.encode_prompts(PROMPTS, None, ROWS)
    settings = SamplerSettings(num_steps=4, guidance=4.0, height=32, width=32, frames=5, sde_type=sde_type,
                               noise_level=0.7 if sde_type == "sde" else 0.3)  # fmt: skip
    traj = rollout(model, cond, settings, SdeWindow(0, 4), init_seeds=[1, 2], noise_seeds=[1, 2],
                   ids=anonymous_ids(PROMPTS))  # fmt: skip
    c = cond["image_latents"][:, 0]
    assert torch.equal(traj.final_latents[:, :, :1], c)
    assert torch.equal(traj.final_latents[:, :, 1:], traj.latents[:, -1, :, 1:])
    assert (traj.latents[:, -1, :, :1] - c).abs().max() > 0.1  # what the last step drew there
    assert torch.equal(traj.images, model.decode(torch.cat([c, traj.latents[:, -1, :, 1:]], dim=2)))


def test_ti2v_trains_from_its_wan_pipeline_checkpoint(wan_ti2v_model_dir, train_model, weights_of, tmp_path):
    edits = ROOT / "configs/prompts/shapes_edits"
    trainer = train_model(wan_ti2v_model_dir, f"run.dir={tmp_path / 'run'}", "model.family=wan_i2v",
                          "train.total_steps=1", "train.lr=1e-2", "sampling.num_frames=5",
                          f"data.train={edits / 'train.jsonl'}", f"val.prompts={edits / 'val.jsonl'}")  # fmt: skip
    before = weights_of(trainer)
    (row,) = trainer.train()
    after = weights_of(trainer)
    assert trainer.engine.model.family == "wan_i2v" and math.isfinite(row["loss"])
    assert row["train/logp_diff_max"] < 1e-4  # the update replays the rollout's steps, first frame included
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_what_the_family_refuses(wan_i2v_model_dir, wan_model_dir, wan_ti2v_model_dir, load):
    model = load(wan_i2v_model_dir)
    with pytest.raises(UserError, match=r"every prompt needs 1 condition image\(s\), got 0"):
        model.encode_prompts(PROMPTS, None)
    with pytest.raises(UserError, match=r"every prompt needs 1 condition image\(s\), got 2"):  # test_wan_flf2v.py
        model.encode_prompts(PROMPTS[:1], None, [[FIRST[0], FIRST[1]]])
    with pytest.raises(UserError, match="cannot take a first frame"):  # Wan 2.1 T2V: no first-frame channels
        load(wan_model_dir, family="wan_i2v")
    assert load(wan_ti2v_model_dir).family == "wan"  # auto: the checkpoint's own pipeline
    with pytest.raises(UserError, match=r"model.max_sequence_length: at most 512 .* CLIP image tokens .* got 513"):
        load(wan_i2v_model_dir, max_sequence_length=513)  # the text would reach into the image tokens' place


def test_lora_export_loads_with_diffusers_and_samples_identical_videos(wan_i2v_model_dir, load, train_model, tmp_path):
    edits = ROOT / "configs/prompts/shapes_edits"
    trainer = train_model(wan_i2v_model_dir, f"run.dir={tmp_path / 'run'}", "model.lora.enabled=true",
                          "model.lora.rank=4", "model.lora.alpha=8", "train.total_steps=1", "train.lr=1e-2",
                          "sampling.num_frames=5", f"data.train={edits / 'train.jsonl'}",
                          f"val.prompts={edits / 'val.jsonl'}")  # fmt: skip
    trainer.train()
    trained = trainer.engine.model
    names = [n for n, p in trained.policies.trained.named_parameters() if p.requires_grad]
    assert any("attn2.add_k_proj.lora_A" in n for n in names)  # the image cross-attention is in the preset
    out = tmp_path / "lora"
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    settings = SamplerSettings(num_steps=4, guidance=4.0, height=32, width=32, frames=5)

    def videos(model):
        cond = model.encode_prompts(PROMPTS, ["", ""], ROWS)
        return rollout(model, cond, settings, None, init_seeds=[1, 2], noise_seeds=[1, 2],
                       ids=anonymous_ids(PROMPTS)).images  # fmt: skip

    fresh = load(wan_i2v_model_dir, max_sequence_length=trained.max_sequence_length)
    before = videos(fresh)
    fresh.pipeline.load_lora_weights(out)  # diffusers' own loader, into a WanImageToVideoPipeline
    after, wanted = videos(fresh), videos(trained)
    assert not torch.equal(before, wanted)  # the update moved the videos
    assert torch.equal(after, wanted)


def test_doctor_reports_the_i2v_model_and_samples_one_video(wan_i2v_model_dir, tmp_path, capsys):
    out = tmp_path / "doctor.png"
    argv = ["doctor", "--model", str(wan_i2v_model_dir), "--dtype", "fp32", "--device", "cpu", "--height", "32",
            "--width", "32", "--frames", "5", "--steps", "2", "--micro-batch", "2", "--max-sequence-length", "16",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "family     wan_i2v" in text and "  image_encoder " in text and "LoRA r=32" in text
    assert out.with_suffix(".webp").is_file()  # a video: the source beside every frame


def test_estimate_reads_the_shipped_wan21_i2v_architecture(capsys, monkeypatch):
    from diffusion_rl.estimate import architectures
    from diffusion_rl.estimate.counting import Shapes, transformer_inputs

    arch = from_shipped("Wan2.1-I2V-14B-480P-Diffusers")
    assert arch.family == "wan_i2v" and (arch.vae_scale, arch.temporal_scale) == (8, 4)
    inputs = transformer_inputs(arch, Shapes(1, 480, 832, 81, 512), torch.bfloat16)
    assert inputs["hidden_states"].shape == (1, 36, 21, 60, 104)  # 16 latents + 4 mask + 16 condition channels
    assert inputs["encoder_hidden_states_image"].shape == (1, 257, 1280)  # ViT-H/14 at 224 px
    config = str(ROOT / "configs/wan21_i2v_lora.yaml")

    monkeypatch.setattr(architectures, "from_shipped", one_block)  # the CLI finds it by the config's model.path
    assert main(["estimate", config, "--gpu", "h100", "--gpus", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["architecture"] == "Wan2.1-I2V-14B-480P-Diffusers"
    assert out["peak_memory_gib_per_gpu"] > 0 and out["step_seconds"] > 0


def test_estimate_counts_the_512_text_tokens_the_i2v_transformer_reads_at_a_shorter_max_sequence_length():
    """Wan2.1-I2V-14B at model.max_sequence_length 226: the transformer reads 512 text tokens (226 and zeros) beside
    257 image tokens, so its work is that at 512; Wan 2.2 I2V-A14B (no image tokens) reads the 226."""
    from diffusion_rl.config import load as load_config
    from diffusion_rl.estimate.counting import Shapes, transformer_inputs
    from diffusion_rl.estimate.devices import DEVICES
    from diffusion_rl.estimate.estimator import estimate
    from diffusion_rl.models.registry import family_named

    i2v, a14b = one_block("Wan2.1-I2V-14B-480P-Diffusers"), one_block("Wan2.2-I2V-A14B-Diffusers")
    adapter = family_named("wan_i2v").adapter
    assert adapter.text_tokens(i2v, 226, 64) == 512 and adapter.text_tokens(a14b, 226, 64) == 226
    inputs = transformer_inputs(i2v, Shapes(1, 480, 832, 81, adapter.text_tokens(i2v, 226, 64)), torch.bfloat16)
    assert inputs["encoder_hidden_states"].shape == (1, 512, 4096)
    assert inputs["encoder_hidden_states_image"].shape == (1, 257, 1280)
    config = str(ROOT / "configs/wan21_i2v_lora.yaml")
    at = {n: estimate(load_config(config, [f"model.max_sequence_length={n}"]), i2v, DEVICES["h100"], 8)
          for n in (226, 512)}  # fmt: skip
    assert "text tokens per sample 512 " in at[226].assumptions[0]
    assert at[226].flops_update == at[512].flops_update  # the transformer's work; the text encoder reads 226
    with pytest.raises(UserError, match="model.max_sequence_length: at most 512"):
        adapter.text_tokens(i2v, 513, 64)
