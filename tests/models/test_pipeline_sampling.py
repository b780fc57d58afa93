"""Our ODE sampler against the families' own diffusers pipelines, end to end, on the same initial noise and prompts
(4 steps, 64 px, fp32): FLUX.1-dev (its guidance embedding), FLUX.1-schnell and Qwen-Image (true CFG, Qwen's
norm-rescaled one and its σ schedule stretched to end at 0.02), and FLUX.1 Kontext (a condition image per row, its
guidance embedding). The pipeline's latents are its own `__call__`'s (`output_type="latent"`), so every schedule,
shift, packing and guidance detail is checked against diffusers itself. Both run the same operations in nearly the
same order: measured max |difference| 0 to 8.3e-7 (2026-11-29); the tolerance is 1e-5. SD3.5, Z-Image, FLUX.2 and
Wan have their own such tests (test_sd35_layout.py, test_z_image.py, test_flux2*.py, test_wan*.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_rl.models.packed import tokens_of
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, initial_noise, rollout

PROMPTS, NEGATIVE = ["a red cube", "a lighthouse at dusk"], ["", "blurry"]
EDITS = ["make the circle blue", "make it night"]
SEEDS = [3, 4]


def _ours(model, guidance: float, negative=None, images=None):
    settings = SamplerSettings(num_steps=4, guidance=guidance, height=64, width=64)
    cond = model.encode_prompts(PROMPTS if images is None else EDITS, negative, images)
    ids = anonymous_ids(PROMPTS)
    traj = rollout(model, cond, settings, None, init_seeds=SEEDS, noise_seeds=SEEDS, ids=ids)
    return tokens_of(traj.final_latents), tokens_of(initial_noise(model, settings, SEEDS))


@pytest.mark.parametrize(
    ("fixture", "guidance", "call", "negative"),
    [("flux_model_dir", 3.5, {"guidance_scale": 3.5}, False),
     ("flux_schnell_model_dir", 3.0, {"true_cfg_scale": 3.0}, True),
     ("qwen_image_model_dir", 4.0, {"true_cfg_scale": 4.0}, True)],
    ids=["flux-dev-embedded-guidance", "flux-schnell-true-cfg", "qwen-image-true-cfg"],
)  # fmt: skip
def test_text_to_image_families_sample_as_their_pipelines(request, load, fixture, guidance, call, negative):
    model = load(request.getfixturevalue(fixture))
    ours, noise = _ours(model, guidance, NEGATIVE if negative else None)
    kwargs = dict(prompt=PROMPTS, height=64, width=64, num_inference_steps=4, max_sequence_length=16,
                  output_type="latent", **call, **({"negative_prompt": NEGATIVE} if negative else {}))  # fmt: skip
    with torch.no_grad():
        theirs = model.pipeline(latents=noise.clone(), **kwargs).images
    assert (theirs - noise).abs().mean() > 0.1  # the 4 steps moved the latents
    assert (ours - theirs).abs().max() <= 1e-5


def test_kontext_samples_as_its_pipeline(flux_kontext_model_dir, load):
    model = load(flux_kontext_model_dir)
    sources = np.random.default_rng(0).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    ours, noise = _ours(model, 2.5, images=[[sources[0]], [sources[1]]])
    with torch.no_grad():
        theirs = torch.cat([
            model.pipeline(image=Image.fromarray(sources[i]), prompt=EDITS[i], latents=noise[i : i + 1].clone(),
                           height=64, width=64, num_inference_steps=4, guidance_scale=2.5, max_sequence_length=16,
                           max_area=64 * 64, _auto_resize=False, output_type="latent").images
            for i in range(2)
        ])  # fmt: skip
    assert (theirs - noise).abs().mean() > 0.1
    assert (ours - theirs).abs().max() <= 1e-5
