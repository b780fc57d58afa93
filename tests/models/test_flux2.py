"""FLUX.2-klein: the tiny model in the real layout, our sampler against Flux2KleinPipeline for the same noise, the
σ schedule by hand, the latents' batch-norm scaling, CFG of the undistilled model, and LoRA export to diffusers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from diffusion_rl.cli import main
from diffusion_rl.models.packed import unpack_latents
from diffusion_rl.models.tiny import build_tiny, save_tiny
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, initial_noise, rollout

PROMPTS = ["a red cube", "a lighthouse at night"]
TOKENS = 32


def _pipeline_latents(model, noise_grid, steps: int, guidance: float, output_type: str):
    """Flux2KleinPipeline's own sampling from our initial noise (its layout [B, 4·C, h, w])."""
    return model.pipeline(prompt=PROMPTS, latents=noise_grid.permute(0, 3, 1, 2), height=32, width=32,
                          num_inference_steps=steps, guidance_scale=guidance, max_sequence_length=TOKENS,
                          output_type=output_type).images  # fmt: skip


@pytest.fixture(scope="module")
def undistilled_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_flux2_base"), "flux2", "small_undistilled", seed=0)


def test_init_tiny_writes_a_klein_that_loads_back_bit_identical(tmp_path, load):
    assert main(["init-tiny", str(tmp_path / "m"), "--family", "flux2", "--preset", "small"]) == 0
    index = json.loads((tmp_path / "m" / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinPipeline" and index["is_distilled"] is True
    assert index["text_encoder"] == ["transformers", "Qwen3ForCausalLM"]
    assert index["vae"] == ["diffusers", "AutoencoderKLFlux2"]
    model, built = load(tmp_path / "m"), build_tiny("flux2", "small", seed=0)
    assert model.family == "flux2" and model.distilled
    for name in ("transformer", "vae", "text_encoder"):
        expected, actual = getattr(built, name).state_dict(), getattr(model.pipeline, name).state_dict()
        assert expected.keys() == actual.keys(), name
        assert all(torch.equal(actual[k], v) for k, v in expected.items()), name


@pytest.mark.parametrize("distilled", [True, False])
def test_ode_sampling_equals_the_pipelines_for_the_same_noise(flux2_model_dir, undistilled_dir, load, distilled):
    # klein: CFG-free, the guidance ignored as the pipeline ignores it; klein base: true CFG with "" as negative
    model = load(flux2_model_dir if distilled else undistilled_dir, max_sequence_length=TOKENS)
    guidance = 4.0
    settings = SamplerSettings(num_steps=4, guidance=guidance, height=32, width=32)
    cond = model.encode_prompts(PROMPTS, None)
    traj = rollout(model, cond, settings, None, init_seeds=[1, 2], noise_seeds=[1, 2], ids=anonymous_ids(PROMPTS))
    assert traj.nfe.tolist() == [4.0 * (1 if distilled else 2)] * 2
    noise = initial_noise(model, settings, [1, 2])
    expected = _pipeline_latents(model, noise, 4, guidance, "latent")  # the VAE latents, batch-norm undone
    mean, std = model._bn_stats(traj.final_latents)
    ours = unpack_latents(traj.final_latents * std + mean)
    # the same operations in the same order: equal here; 1e-5 leaves room for other CPUs' kernels
    assert (ours - expected).abs().max() <= 1e-5
    pixels = _pipeline_latents(model, noise, 4, guidance, "pt")  # [B, 3, H, W] in [0, 1]
    expected_uint8 = (pixels * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert (traj.images.int() - expected_uint8.int()).abs().max() <= 1


def test_sigma_schedule_is_the_empirical_mu_exponential_shift(flux2_model_dir, load):
    model = load(flux2_model_dir)
    tokens, steps = 4 * 4, 4  # 32 px: 4× VAE, 2×2 patches
    # compute_empirical_mu by hand: the line through (10 steps, m_10) and (200 steps, m_200) at this token count
    m_10, m_200 = 8.73809524e-05 * tokens + 1.89833333, 0.00016927 * tokens + 0.45666666
    a = (m_200 - m_10) / 190.0
    mu = a * steps + (m_200 - 200.0 * a)
    expected = [math.exp(mu) / (math.exp(mu) + (1 / s - 1)) for s in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    assert torch.allclose(model.sigma_schedule(steps, 32, 32), torch.tensor(expected), atol=1e-6)


def test_latents_are_the_patchified_vae_latents_normalised_by_its_batch_norm(flux2_model_dir, load):
    model = load(flux2_model_dir)
    vae = model.pipeline.vae
    latents = torch.randn(1, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    assert latents.shape == (1, 4, 4, 16)  # 4× VAE, 2×2 patches of 4 channels
    mean, var = vae.bn.running_mean, vae.bn.running_var
    z = latents * torch.sqrt(var + 1e-4) + mean  # batch_norm_eps of AutoencoderKLFlux2
    z = z.reshape(1, 4, 4, 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(1, 4, 8, 8)  # unpatchified by hand
    with torch.no_grad():
        pixels = vae.decode(z, return_dict=False)[0]
    expected = ((pixels / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(model.decode(latents), expected)
    images = model.decode(latents)
    with torch.no_grad():  # encode: the posterior's mode, patchified by hand, then normalised
        z = vae.encode(images.permute(0, 3, 1, 2).float() / 127.5 - 1).latent_dist.mode()
    z = z.reshape(1, 4, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 4, 4, 16)
    assert torch.allclose(model.encode(images), (z - mean) / torch.sqrt(var + 1e-4), atol=1e-5)


def test_distilled_klein_ignores_negative_prompts_and_runs_one_forward(flux2_model_dir, load, caplog):
    from diffusion_rl.models.families.flux2 import warn_guidance_ignored

    warn_guidance_ignored.cache_clear()  # said once per value and process
    model = load(flux2_model_dir)
    calls = []
    model.pipeline.transformer.register_forward_pre_hook(lambda _, a, kw: calls.append(kw), with_kwargs=True)
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model.velocity(x, 0.5, model.encode_prompts(PROMPTS, ["", ""]), 4.0)
        b = model.velocity(x, 0.5, model.encode_prompts(PROMPTS, ["ugly", "blurry"]), 4.0)
    assert torch.equal(a, b) and model.forwards_per_evaluation(4.0) == 1
    assert "guidance 4 is ignored" in caplog.text  # said, not silently dropped
    assert calls[0]["hidden_states"].shape[0] == 2 and calls[0]["timestep"].tolist() == [0.5, 0.5]
    assert calls[0]["img_ids"][5].tolist() == [0, 1, 1, 0]  # (t, row, column, layer) of token 5 in a 4×4 grid
    assert calls[0]["txt_ids"][3].tolist() == [0, 0, 0, 3]


def test_lora_export_loads_with_diffusers_and_samples_identical_images(
    flux2_model_dir, load, train_model, tmp_path, ode_images
):
    trainer = train_model(flux2_model_dir, f"run.dir={tmp_path / 'run'}", "model.lora.enabled=true",
                          "model.lora.rank=4", "model.lora.alpha=8", "train.total_steps=1", "train.lr=1e-2",
                          "sampling.guidance=1")  # fmt: skip
    trainer.train()
    trained = trainer.engine.model
    out = tmp_path / "lora"
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    settings = SamplerSettings(num_steps=4, guidance=1.0, height=32, width=32)

    def images(model):
        return ode_images(model, PROMPTS, settings)

    fresh = load(flux2_model_dir)
    before = images(fresh)
    fresh.pipeline.load_lora_weights(out)  # diffusers' own loader
    after, wanted = images(fresh), images(trained)
    assert not torch.equal(before, wanted)  # the update moved the images
    assert torch.equal(after, wanted)


def test_doctor_reports_the_klein_and_samples_one_image(flux2_model_dir, tmp_path, capsys):
    out = tmp_path / "doctor.png"
    argv = ["doctor", "--model", str(flux2_model_dir), "--dtype", "fp32", "--device", "cpu", "--height", "32"]
    argv += ["--width", "32", "--steps", "2", "--micro-batch", "2", "--max-sequence-length", "16", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "family     flux2" in text and "  text_encoder " in text and "LoRA r=32" in text
    assert out.is_file() and out.stat().st_size > 0


def test_estimate_reads_the_shipped_klein_architecture(capsys):
    from diffusion_rl.estimate.architectures import from_shipped

    arch = from_shipped("FLUX.2-klein-4B")
    (qwen3,) = arch.text_encoders
    # Qwen3-4B by hand: 36 layers of (q, o: 2560×4096; k, v: 2560×1024; gated MLP 3 × 2560×9728) + the embeddings
    # (tied with the LM head): 4.02B, the published count
    layer = 2 * 2560 * 4096 + 2 * 2560 * 1024 + 3 * 2560 * 9728
    assert qwen3.kind == "qwen3" and qwen3.weight_params == 36 * layer + 151936 * 2560
    assert arch.vae_scale == 8 and arch.transformer_config["joint_attention_dim"] == 3 * 2560  # three layers' states
    config = str(Path(__file__).resolve().parents[2] / "configs/flux2_klein_pickscore_lora.yaml")
    assert main(["estimate", config, "--gpu", "h100", "--gpus", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["peak_memory_gib_per_gpu"] < 74.5 and out["step_seconds"] > 0 and out["fits"] is True


def test_lora_preset_covers_both_streams_the_feed_forwards_and_the_fused_single_input(flux2_model_dir, load):
    trained = load(flux2_model_dir, lora=True).policies.trained.named_parameters()
    names = {n for n, p in trained if p.requires_grad}
    for part in ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj", "attn.to_add_out",
                 "transformer_blocks.0.ff.linear_in", "ff_context.linear_out",
                 "single_transformer_blocks.0.attn.to_qkv_mlp_proj"):  # fmt: skip
        assert any(part in n for n in names), part
    assert all("lora_" in n for n in names)
    assert not any(".proj_out." in n or "x_embedder" in n for n in names)  # input and output layers stay frozen
