"""Tiny random-weight models of every family, by (family, preset): what `diffusion-rl init-tiny` writes."""

from __future__ import annotations

from pathlib import Path

from diffusion_rl.errors import UserError
from diffusion_rl.models.tiny import TINY_PRESETS, build_tiny_pipeline
from diffusion_rl.models.tiny_flux import TINY_FLUX_PRESETS, build_tiny_flux_pipeline
from diffusion_rl.models.tiny_qwen_image import TINY_QWEN_IMAGE_PRESETS, build_tiny_qwen_image_pipeline

# family → (presets, builder(spec, seed) → diffusers pipeline)
TINY_FAMILIES = {
    "sd3": (TINY_PRESETS, build_tiny_pipeline),
    "flux": (TINY_FLUX_PRESETS, build_tiny_flux_pipeline),
    "qwen_image": (TINY_QWEN_IMAGE_PRESETS, build_tiny_qwen_image_pipeline),
}


def tiny_preset_names() -> list[str]:
    """Every preset name of any family (what `--preset` accepts before the family narrows it)."""
    return sorted({name for presets, _ in TINY_FAMILIES.values() for name in presets})


def build_tiny(family: str = "sd3", preset: str = "base", seed: int = 0):
    """The tiny diffusers pipeline of `family` at `preset` with random weights drawn from `seed`."""
    if family not in TINY_FAMILIES:
        raise UserError(f"no tiny model for family '{family}'; families: {', '.join(TINY_FAMILIES)}")
    presets, build = TINY_FAMILIES[family]
    if preset not in presets:
        raise UserError(f"the tiny {family} model has no preset '{preset}'; presets: {', '.join(presets)}")
    return build(presets[preset], seed)


def save_tiny(directory: str | Path, family: str = "sd3", preset: str = "base", seed: int = 0) -> Path:
    """Write the tiny model of `family` in diffusers format to `directory` and return it."""
    directory = Path(directory)
    build_tiny(family, preset, seed).save_pretrained(directory)
    return directory
