"""model.condition_size: an editing family reads its condition images at the output size (`output`) or at the size its
diffusers pipeline gives them (`pipeline`). The sizes are checked by hand, and at `pipeline` the condition tokens
the transformer reads are the ones the pipeline's own __call__ hands it (its image resize included)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_rl.data.condition_images import ConditionImage
from diffusion_rl.models.families.flux2 import Flux2Model
from diffusion_rl.models.families.flux_kontext import FluxKontextModel
from diffusion_rl.models.families.qwen_image_edit import QwenImageEditModel

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("adapter", "output", "expected"),
    [
        # FLUX.1 Kontext: the preferred (width, height) whose w / h is nearest the output's
        (FluxKontextModel, (512, 512), (1024, 1024)),
        (FluxKontextModel, (512, 768), (832, 1248)),  # w / h = 1.5: (1248, 832) exactly
        (FluxKontextModel, (480, 832), (800, 1328)),  # 1.733: 1328 / 800 = 1.66 beats 1392 / 752 = 1.85
        (FluxKontextModel, (32, 32), (1024, 1024)),  # whatever the output size
        # Qwen-Image-Edit: 1024² pixels at the aspect ratio, sides rounded to multiples of 32
        (QwenImageEditModel, (512, 768), (832, 1248)),  # w = √(1024² · 1.5) = 1254.2 → 1248, h = 836.1 → 832
        (QwenImageEditModel, (480, 832), (768, 1344)),  # w = 1348.2 → 1344, h = 777.8 → 768
        # FLUX.2: 1024² pixels at the aspect ratio, each side cut to a multiple of 16
        (Flux2Model, (512, 768), (832, 1248)),  # as Qwen-Image-Edit's, cut to 16 instead of 32
        (Flux2Model, (480, 832), (768, 1344)),  # h = 777.8 → 768, w = 1348.2 → 1344
        (Flux2Model, (32, 32), (1024, 1024)),  # whatever the output size
    ],
)
def test_pipeline_condition_sizes_by_hand(adapter, output, expected):
    assert adapter.condition_size("pipeline", *output) == expected
    assert adapter.condition_size("output", *output) == output


def _first_transformer_call(pipe, **call) -> dict:
    """The keyword arguments of the pipeline's first transformer call (one step, latents out)."""
    seen = []
    forward = pipe.transformer.forward

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return forward(*args, **kwargs)

    pipe.transformer.forward = spy
    try:
        pipe(num_inference_steps=1, output_type="latent", generator=torch.Generator().manual_seed(0), **call)
    finally:
        del pipe.transformer.forward
    return seen[0]


# FluxKontextPipeline rescales its output to max_area pixels (default 1024²) unless told the output's area
KEYWORDS = {"flux_kontext": {"guidance_scale": 3.5, "max_area": 32 * 48}, "qwen_image_edit": {"true_cfg_scale": 1.0},
            "flux2": {"guidance_scale": 1.0}}  # fmt: skip


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # the scheduler's 1-step shift
@pytest.mark.parametrize("name", ["flux_kontext", "qwen_image_edit", "flux2"])
def test_pipeline_size_gives_the_transformer_the_pipelines_condition_tokens(edit_dirs, flux2_model_dir, load,
                                                                            tmp_path, name):  # fmt: skip
    """Output 32 × 48 (w / h 1.5): the three pipelines read the source at 832 × 1248; a source of exactly that size
    is resized by none, so their condition tokens and ours must agree to rounding."""
    model_dir = flux2_model_dir if name == "flux2" else edit_dirs[name]
    model = load(model_dir, max_sequence_length=512, condition_size="pipeline")
    height, width = 32, 48
    pixels = np.random.default_rng(3).integers(0, 256, (832, 1248, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "source.png")
    rows = [[ConditionImage(str(tmp_path / "source.png"), "source.png")]]
    fitted = model.fit_conditions(rows, height, width)
    assert fitted[0][0].shape == (832, 1248, 3)
    ours = model.encode_prompts(["make it blue"], [""], fitted)["image_latents"]  # [1, 1, h', w', K]
    generated = int(np.prod(model.latent_shape(height, width)[:-1]))  # the generated image's tokens
    with torch.no_grad():
        call = _first_transformer_call(model.pipeline, image=Image.fromarray(pixels), prompt="make it blue",
                                       height=height, width=width, **KEYWORDS[name])  # fmt: skip
    theirs = call["hidden_states"][:, generated:]
    assert ours.shape[2:4] == (832 // model.vae_scale // 2, 1248 // model.vae_scale // 2)
    assert theirs.shape == (1, ours.shape[2] * ours.shape[3], ours.shape[-1])
    assert torch.allclose(ours.reshape(theirs.shape), theirs.float(), atol=1e-5)
    if name == "qwen_image_edit":  # the transformer's positions of the source: its own grid after the generated one
        assert call["img_shapes"][0][1] == (1, *ours.shape[2:4])
    # at `output` the same source is fitted to 32 × 48: 4 × 6 packed cells instead of 52 × 78
    model.condition_sizing = "output"
    assert model.fit_conditions(rows, height, width)[0][0].shape == (height, width, 3)


def test_estimate_counts_the_condition_tokens_at_the_size_read():
    from diffusion_rl.estimate.architectures import from_shipped
    from diffusion_rl.estimate.counting import Shapes, transformer_inputs

    arch = from_shipped("FLUX.1-Kontext-dev")
    at_output = transformer_inputs(arch, Shapes(1, 512, 512, 1, 512, 1), torch.bfloat16)
    at_pipeline = transformer_inputs(arch, Shapes(1, 512, 512, 1, 512, 1, (1024, 1024)), torch.bfloat16)
    # 512² output: 32 × 32 packed tokens; the source 32 × 32 at the output size, 64 × 64 at the pipeline's
    assert at_output["hidden_states"].shape[1] == 1024 + 1024
    assert at_pipeline["hidden_states"].shape[1] == 1024 + 4096
    assert at_pipeline["img_ids"].shape[0] == 1024 + 4096


@pytest.mark.parametrize("sizing", ["output", "pipeline"])
def test_training_rollouts_read_the_sources_at_the_configured_size(flux_kontext_model_dir, make_config, sizing):
    """The worker's rollouts (what `update` trains on) carry the source latents at the size model.condition_size
    names: the 32² output's, or Kontext's pipeline size for it, 1024²."""
    from diffusion_rl.trainer.timing import PhaseTimer
    from diffusion_rl.trainer.trainer import Trainer

    edits = ROOT / "configs/prompts/shapes_edits/train.jsonl"
    cfg = make_config(f"model.path={flux_kontext_model_dir}", "model.family=flux_kontext", f"data.train={edits}",
                      f"model.condition_size={sizing}", "data.prompts_per_step=1", "data.group_size=2",
                      "sampling.num_steps=2", "val.prompts=null",
                      config=ROOT / "configs/quickstart_edit.yaml")  # fmt: skip
    trainer = Trainer(cfg)
    trainer.source.collect(0, None, PhaseTimer())
    sources = trainer.engine.kept.rows(0).cond["image_latents"]  # [B, 1, h', w', K]
    side = (32 if sizing == "output" else 1024) // (2 * trainer.engine.model.vae_scale)  # packed 2 × 2 VAE cells
    assert sources.shape[:4] == (2, 1, side, side)
