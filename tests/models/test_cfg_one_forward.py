"""Classifier-free guidance in one transformer forward for every family (issue 45, "CFG halves in one batch").

One `velocity` call at a CFG scale must run the transformer once over [uncond; cond] (2B rows), not twice over B,
and give what the two halves computed apart and combined give: fp32 on the CPU, within 1e-5 (batching changes the
matmuls' blocking, so the last bits may differ; measured ≤ 2.4e-6 on these models). A guidance-distilled family
(FLUX.1-dev, Kontext, FLUX.2-klein) takes the scale as an input: one forward over B rows, whatever the scale.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffusion_rl.models.families.qwen_image import norm_rescaled_cfg
from diffusion_rl.models.guidance import guided
from diffusion_rl.models.tiny import save_tiny

SCALE, SIGMA = 4.0, 0.6
PROMPTS = ["a red cube on a wooden table", "a ball"]
NEGATIVE = ["blurry", "low quality, watermark, text"]  # lengths unlike the prompts': padding and masks matter
IMAGES = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)

# name → (tiny family, preset, load overrides, frames, condition images per row, CFG batched (else distilled))
CASES = {
    "sd3": ("sd3", "small", {}, 1, 0, True),
    "flux_schnell": ("flux", "schnell", {}, 1, 0, True),
    "flux_dev": ("flux", "small", {}, 1, 0, False),
    "flux_kontext": ("flux_kontext", "small", {}, 1, 1, False),
    "flux2_base": ("flux2", "small_undistilled", {}, 1, 0, True),
    "flux2_klein": ("flux2", "small", {}, 1, 0, False),
    "qwen_image": ("qwen_image", "small", {}, 1, 0, True),
    "qwen_image_edit": ("qwen_image_edit", "small", {"max_sequence_length": 512}, 1, 1, True),
    "z_image": ("z_image", "small", {}, 1, 0, True),
    "wan": ("wan", "small", {}, 5, 0, True),
    "wan_a14b": ("wan", "a14b", {}, 5, 0, True),
    "wan_ti2v": ("wan", "ti2v", {"family": "wan_i2v"}, 5, 1, True),
    "wan_i2v": ("wan_i2v", "small", {}, 5, 1, True),
}
NORM_RESCALED = {"qwen_image", "qwen_image_edit"}  # Qwen-Image's pipelines rescale the guided velocity per token


@pytest.fixture(scope="module")
def case_dirs(tmp_path_factory):
    made = {}

    def directory(name: str):
        family, preset = CASES[name][:2]
        if (family, preset) not in made:
            made[family, preset] = save_tiny(tmp_path_factory.mktemp(f"{family}_{preset}"), family, preset, seed=0)
        return made[family, preset]

    return directory


def transformers_of(model) -> list[torch.nn.Module]:
    pipeline = model.pipeline
    return [t for t in (pipeline.transformer, getattr(pipeline, "transformer_2", None)) if t is not None]


def rows_of(kwargs: dict, args: tuple) -> int:
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    return len(hidden) if isinstance(hidden, list) else hidden.shape[0]  # Z-Image takes a list of samples


def as_conditional(cond):
    """The conditioning whose prompts are `cond`'s negative ones: the unconditional half run on its own."""
    swapped = cond.clone()
    for key in [k for k in cond.keys() if k.startswith("negative_")]:  # noqa: SIM118  (TensorDict's keys)
        swapped[key.removeprefix("negative_")] = cond[key]
    return swapped


@pytest.mark.parametrize("name", list(CASES))
def test_a_cfg_step_runs_the_transformer_once_over_both_halves(case_dirs, load, name):
    _, _, overrides, frames, images, batched = CASES[name]
    model = load(case_dirs(name), **overrides)
    calls = []
    for transformer in transformers_of(model):
        transformer.register_forward_pre_hook(lambda _, a, kw: calls.append(rows_of(kw, a)), with_kwargs=True)
    rows = [[IMAGES[i]] * images for i in range(2)] if images else None
    cond = model.encode_prompts(PROMPTS, NEGATIVE, rows) if rows else model.encode_prompts(PROMPTS, NEGATIVE)
    x = torch.randn(2, *model.latent_shape(32, 32, frames), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = model.velocity(x, SIGMA, cond, SCALE)
        assert calls == [4 if batched else 2]  # one forward: [uncond; cond], or the distilled B rows
        assert model.forwards_per_evaluation(SCALE) == (2 if batched else 1)
        if not batched:
            return
        v_cond = model.velocity(x, SIGMA, cond, 1.0)
        v_uncond = model.velocity(x, SIGMA, as_conditional(cond), 1.0)
    assert calls[1:] == [2, 2]  # each half on its own
    combine = norm_rescaled_cfg if name in NORM_RESCALED else guided
    apart = combine(v_uncond, v_cond, SCALE)
    assert not torch.allclose(v_cond, v_uncond, atol=1e-3)  # the negative prompts matter: the check can fail
    assert (v - apart).abs().max() <= 1e-5
