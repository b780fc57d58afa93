"""FLUX.2 reference images (the pipelines' `image`): our sampler with 1 or 2 references against Flux2KleinPipeline
(klein, klein base) and Flux2Pipeline (dev) for the same noise, the references' positional ids, a Flow-GRPO step on
an edit dataset that replays its log-probs, LoRA export that gives diffusers' images with the references, and
estimate counting the reference tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_rl.cli import main
from diffusion_rl.models.packed import unpack_latents
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, initial_noise, rollout

ROOT = Path(__file__).resolve().parents[2]
EDITS = ROOT / "configs/prompts/shapes_edits"
PROMPTS = ["make the circle blue", "remove the square"]
TOKENS = 32


def references(n: int, seed: int = 0, size: int = 32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]


def sample(model, settings, images, seeds=(1, 2)):
    cond = model.encode_prompts(PROMPTS, None, images)
    return rollout(model, cond, settings, None, init_seeds=list(seeds), noise_seeds=list(seeds),
                   ids=anonymous_ids(PROMPTS))  # fmt: skip


@pytest.fixture(scope="module")
def preset_dirs(flux2_model_dir, tmp_path_factory):
    """preset → a tiny model directory: klein ("small"), klein base, FLUX.2-dev."""
    from diffusion_rl.models.tiny import save_tiny

    root = tmp_path_factory.mktemp("tiny_flux2_refs")
    others = {p: save_tiny(root / p, "flux2", p, seed=0) for p in ("small_undistilled", "small_dev")}
    return {"small": flux2_model_dir, **others}


# klein (CFG-free), klein base (true CFG: both halves see the references), dev (the guidance embedding; Flux2Pipeline)
@pytest.mark.parametrize("preset, count", [("small", 1), ("small", 2), ("small_undistilled", 2), ("small_dev", 2)])
def test_sampling_with_references_equals_the_pipelines_for_the_same_noise(preset_dirs, load, preset, count):
    model = load(preset_dirs[preset], max_sequence_length=TOKENS)
    guidance = 4.0
    # 64 px: the pipeline refuses references under 64 px a side (we take them: the tiny runs are at 32 px)
    settings = SamplerSettings(num_steps=4, guidance=guidance, height=64, width=64)
    refs = references(count, seed=3, size=64)
    traj = sample(model, settings, [refs, refs])
    noise = initial_noise(model, settings, [1, 2])
    expected = model.pipeline(prompt=PROMPTS, image=[Image.fromarray(r) for r in refs], height=64, width=64,
                              latents=noise.permute(0, 3, 1, 2), num_inference_steps=4, guidance_scale=guidance,
                              max_sequence_length=TOKENS, output_type="latent").images  # fmt: skip
    if preset == "small_dev":  # Flux2Pipeline's latents: its normalised tokens [B, h·w, 4·C]
        ours = traj.final_latents.reshape(expected.shape)
    else:  # Flux2KleinPipeline's: the VAE latents, batch-norm undone
        mean, std = model._bn_stats(traj.final_latents)
        ours = unpack_latents(traj.final_latents * std + mean)
    # the pipeline scales pixels as x/255·2−1, we as x/127.5−1: an ulp apart; 1e-5 also leaves room for other CPUs
    assert (ours - expected).abs().max() <= 1e-5
    plain = sample(model, settings, None)  # the references matter: without them, other samples
    assert (plain.final_latents - traj.final_latents).abs().max() > 1e-3


def test_reference_tokens_follow_the_generated_ones_with_their_time_offsets(flux2_model_dir, load):
    model = load(flux2_model_dir)
    calls = []
    model.pipeline.transformer.register_forward_pre_hook(lambda _, a, kw: calls.append(kw), with_kwargs=True)
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    a, b = references(2, seed=5)
    cond = model.encode_prompts(["edit", "edit"], None, [[a, b], [b, a]])
    assert cond["image_latents"].shape == (2, 2, 4, 4, 16)  # [B, k, h, w, 4·C]
    assert torch.equal(cond["image_latents"][0, 0], cond["image_latents"][1, 1])  # each distinct image once
    with torch.no_grad():
        v = model.velocity(x, 0.5, cond, 1.0)
    assert v.shape == x.shape
    hidden, ids = calls[0]["hidden_states"], calls[0]["img_ids"]
    assert hidden.shape == (2, 16 * 3, 16) and ids.shape == (16 * 3, 4)
    assert torch.equal(hidden[:, 16:32], cond["image_latents"][:, 0].reshape(2, 16, 16))
    assert ids[5].tolist() == [0, 1, 1, 0]  # generated token 5 of the 4×4 grid
    assert ids[16 + 5].tolist() == [10, 1, 1, 0] and ids[32 + 5].tolist() == [20, 1, 1, 0]  # references 0 and 1
    with torch.no_grad():  # no references: the text-to-image velocity, as before
        calls.clear()
        model.velocity(x, 0.5, model.encode_prompts(["edit", "edit"]), 1.0)
    assert calls[0]["hidden_states"].shape[1] == 16


class Seen(Exception):
    """Raised by a spy once it has what the test wants: the VAE is not run on images this large."""


@pytest.mark.parametrize("height, width", [(1040, 1536), (64, 64)], ids=["over_1024sq", "small"])
def test_references_reach_the_vae_sized_as_the_pipeline_sizes_them(flux2_model_dir, load, height, width):
    """Over 1024² pixels the pipeline shrinks a reference to that area (then cuts it to multiples of the VAE
    scale × 2, centre-cropped): the pixels our encode hands the VAE are the ones Flux2KleinPipeline hands it (both
    caught before the VAE runs), for an image over that limit and one under it."""
    from diffusion_rl.models.families.flux2 import REFERENCE_MAX_PIXELS

    model = load(flux2_model_dir, max_sequence_length=TOKENS)
    image = np.random.default_rng(7).integers(0, 256, (height, width, 3), dtype=np.uint8)
    seen = {}

    def ours(pixels, *args, **kwargs):
        seen["ours"] = pixels
        raise Seen

    def pipelines(images, *args, **kwargs):
        seen["pipeline"] = images[0]
        raise Seen

    model.vae.encode = ours
    model.pipeline.prepare_image_latents = pipelines
    try:
        with pytest.raises(Seen):
            model.encode_prompts(PROMPTS[:1], None, [[image]])
        with pytest.raises(Seen):
            model.pipeline(prompt=PROMPTS[:1], image=Image.fromarray(image), height=64, width=64,
                           max_sequence_length=TOKENS, num_inference_steps=1)  # fmt: skip
    finally:
        del model.vae.encode, model.pipeline.prepare_image_latents
    expected = seen["pipeline"].float()
    assert seen["ours"].shape == expected.shape  # [1, 3, h, w]
    h, w = expected.shape[2:]
    if height * width > REFERENCE_MAX_PIXELS:  # shrunk to 842 × 1244, then cut to multiples of 8 (the tiny VAE's 4×
        assert (h, w) == (840, 1240)  # down-sampling, then 2×2 patches; 16 with a real FLUX.2 VAE)
    else:
        assert (h, w) == (height, width)
    # the pipeline scales pixels as x/255·2−1, we as x/127.5−1: an ulp apart
    assert (seen["ours"].float() - expected).abs().max() <= 1e-6


EDIT_RUN = [f"data.train={EDITS / 'train.jsonl'}", f"val.prompts={EDITS / 'val.jsonl'}",
            "rewards.0.name=source_preservation", "sampling.guidance=1"]  # fmt: skip


def test_a_flow_grpo_step_with_references_replays_its_log_probs(flux2_model_dir, train_model):
    trainer = train_model(flux2_model_dir, *EDIT_RUN, "train.total_steps=1", "val.before_train=true")
    encoded = []
    model = trainer.engine.model
    model_encode = model.encode
    model.encode = lambda images: encoded.append(len(images)) or model_encode(images)
    rows = trainer.train()
    # validation's 6 sources (in chunks of 4 and 2), then the step's 2 (one per prompt, group of 2): each encoded once
    assert encoded == [4, 2, 2] and np.isfinite(rows[0]["val/reward/mean"])
    assert rows[-1]["train/logp_diff_max"] == 0.0
    assert np.isfinite(rows[-1]["reward/mean"]) and rows[-1]["train/optimizer_steps"] >= 1


def test_lora_export_with_references_gives_diffusers_identical_images(flux2_model_dir, load, train_model, tmp_path):
    trainer = train_model(flux2_model_dir, *EDIT_RUN, "model.lora.enabled=true", "model.lora.rank=4",
                          "model.lora.alpha=8", "train.total_steps=1", "train.lr=1e-2")  # fmt: skip
    trainer.train()
    out = tmp_path / "lora"
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    settings = SamplerSettings(num_steps=4, guidance=1.0, height=32, width=32)
    refs = [references(1, seed=8), references(1, seed=9)]
    fresh = load(flux2_model_dir)
    before = sample(fresh, settings, refs).images
    fresh.pipeline.load_lora_weights(out)  # diffusers' own loader
    after, wanted = sample(fresh, settings, refs).images, sample(trainer.engine.model, settings, refs).images
    assert not torch.equal(before, wanted)  # the update moved the images
    assert torch.equal(after, wanted)


def test_estimate_counts_the_reference_tokens(tmp_path, capsys):
    import json

    from diffusion_rl.estimate.architectures import from_shipped
    from diffusion_rl.estimate.counting import Shapes, transformer_inputs

    arch = from_shipped("FLUX.2-klein-4B")
    inputs = transformer_inputs(arch, Shapes(1, 1024, 1024, 1, 512, sources=2), torch.bfloat16)
    tokens = (1024 // 16) ** 2  # 8× VAE, 2×2 patches
    assert inputs["hidden_states"].shape == (1, 3 * tokens, 128) and inputs["img_ids"].shape == (3 * tokens, 4)
    # at 2048 × 1536 a reference is shrunk to 1024² pixels' area first (the pipelines' rule): 1182 × 886 → 1168 × 880
    inputs = transformer_inputs(arch, Shapes(1, 2048, 1536, 1, 512, sources=1), torch.bfloat16)
    assert inputs["hidden_states"].shape[1] == 128 * 96 + (1168 // 16) * (880 // 16)
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    from diffusion_rl.models.families.flux2 import Flux2Model, reference_pixels, reference_size, reference_tokens

    for height, width in ((1024, 1024), (1040, 1536), (3008, 1008), (512, 768)):  # as the model feeds them
        fed = reference_pixels(np.zeros((height, width, 3), np.uint8), Flux2ImageProcessor(vae_scale_factor=16), 16)
        assert reference_tokens(height // 8, width // 8) == (fed.shape[0] // 16) * (fed.shape[1] // 16)
        assert reference_size(height, width) == fed.shape[:2]  # what the VAE encodes
    # so the VAE encodes each reference at that size: 2048 × 1536 ones at 1168 × 880
    assert Flux2Model.condition_encodes({}, 2, 1, (2048, 1536)) == [(1, 1168, 880)] * 2
    for i in range(2):
        Image.fromarray(references(1, seed=i, size=64)[0]).save(tmp_path / f"{i}.png")
    (tmp_path / "two.jsonl").write_text(json.dumps({"prompt": "put them together", "images": ["0.png", "1.png"]}))
    config = str(ROOT / "configs/flux2_klein_pickscore_lora.yaml")

    def estimated(*overrides):
        assert main(["estimate", config, *overrides, "--gpu", "h100", "--gpus", "8", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    plain, two = estimated(), estimated(f"data.train={tmp_path / 'two.jsonl'}")
    assert "condition images per sample 0 (" in plain["assumptions"][1]  # a .txt dataset: none
    assert "condition images per sample 2 (" in two["assumptions"][1]
    # every layer's FLOPs grow at least linearly in the tokens it reads: 512 px gives 32² image tokens, plus 512 text
    image, text = (512 // 16) ** 2, 512
    assert two["flops_rollout"] / plain["flops_rollout"] > (3 * image + text) / (image + text)
    assert two["peak_memory_gib_per_gpu"] > plain["peak_memory_gib_per_gpu"]
