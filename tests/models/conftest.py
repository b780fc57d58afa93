"""Tiny FLUX.1 and Qwen-Image models (small presets) saved once per session, and helpers to load and train them."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.models.loader import load_model
from diffusion_rl.models.tiny import save_tiny
from diffusion_rl.trainer.trainer import Trainer


@pytest.fixture(scope="session")
def flux_model_dir(tmp_path_factory):
    """A tiny FLUX.1-dev-format model (guidance embedding, dynamic shift), written with save_pretrained."""
    return save_tiny(tmp_path_factory.mktemp("tiny_flux"), "flux", "small", seed=0)


@pytest.fixture(scope="session")
def flux_schnell_model_dir(tmp_path_factory):
    """A tiny FLUX.1-schnell-format model (no guidance embedding, no dynamic shift)."""
    return save_tiny(tmp_path_factory.mktemp("tiny_flux_schnell"), "flux", "schnell", seed=0)


@pytest.fixture(scope="session")
def qwen_image_model_dir(tmp_path_factory):
    """A tiny Qwen-Image-format model (Qwen2.5-VL text encoder, AutoencoderKLQwenImage)."""
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen_image"), "qwen_image", "small", seed=0)


@pytest.fixture
def edit_dirs(qwen_image_edit_model_dir, qwen_image_edit_2511_model_dir, flux_kontext_model_dir):
    """name → tiny model directory of every editing family (qwen_image_edit, its 2511 preset, flux_kontext)."""
    return {
        "qwen_image_edit": qwen_image_edit_model_dir,
        "qwen_image_edit_2511": qwen_image_edit_2511_model_dir,
        "flux_kontext": flux_kontext_model_dir,
    }


@pytest.fixture
def family_dirs(tiny_model_dir, flux_model_dir, flux_schnell_model_dir, flux2_model_dir, qwen_image_model_dir,
                z_image_model_dir, wan_model_dir, wan_ti2v_model_dir):  # fmt: skip
    """name → tiny model directory of every family (sd3, flux, flux_schnell, flux2, qwen_image, z_image, wan,
    wan_ti2v)."""
    return {
        "sd3": tiny_model_dir,
        "flux": flux_model_dir,
        "flux_schnell": flux_schnell_model_dir,
        "flux2": flux2_model_dir,
        "qwen_image": qwen_image_model_dir,
        "z_image": z_image_model_dir,
        "wan": wan_model_dir,
        "wan_ti2v": wan_ti2v_model_dir,
    }


def load_tiny(path, lora: bool = False, **model_overrides):
    """The FlowModel of a tiny model directory on the CPU (LoRA rank 4, alpha 8 when `lora`)."""
    lora_cfg = LoraConfig(enabled=lora, rank=4, alpha=8)
    model_overrides = {"max_sequence_length": 16, "device": "cpu", **model_overrides}
    cfg = ModelConfig(path=str(path), lora=lora_cfg, **model_overrides)
    return load_model(cfg)


@pytest.fixture
def load():
    return load_tiny


@pytest.fixture
def ode_images():
    """ode_images(model, prompts, settings) → the images [B, H, W, 3] the model samples for `prompts` with `settings`
    from the seeds 1, 2, … (one per prompt; no negative prompts)."""
    from diffusion_rl.sampling.rollout import anonymous_ids, rollout

    def sample(model, prompts, settings):
        seeds = list(range(1, len(prompts) + 1))
        cond = model.encode_prompts(prompts, None)
        return rollout(model, cond, settings, None, init_seeds=seeds, noise_seeds=seeds, ids=anonymous_ids(prompts))

    return lambda model, prompts, settings: sample(model, prompts, settings).images


@pytest.fixture
def i2v_pipeline_text(monkeypatch):
    """WanImageToVideoPipeline encoding its own prompts: its prompt cleaning calls ftfy (not a dependency here)
    unguarded (diffusers 0.42.1); an identity stands in, which ftfy.fix_text is on plain ASCII prompts."""
    fix = type("ftfy", (), {"fix_text": staticmethod(lambda text: text)})
    monkeypatch.setattr("diffusers.pipelines.wan.pipeline_wan_i2v.ftfy", fix, raising=False)


@pytest.fixture
def train_model(make_config):
    """train_model(model_dir, *overrides) → a Trainer of the fast test config on that model."""

    def make(model_dir, *overrides: str) -> Trainer:
        return Trainer(make_config(f"model.path={model_dir}", *overrides))

    return make


def velocity_probe(model, guidance: float = 1.0, prompts=("a red cube", "a blue ball"), size: int = 32):
    """The model's velocity on fixed latents (seeded), σ = 0.6 and fixed prompts, without gradients."""
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn((len(prompts), *model.latent_shape(size, size)), generator=generator)
    cond = model.encode_prompts(list(prompts), ["blurry"] * len(prompts))
    with torch.no_grad():
        return model.velocity(latents, 0.6, cond, guidance)


@pytest.fixture
def velocity_of():
    return velocity_probe
