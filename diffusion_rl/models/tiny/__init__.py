"""Tiny random-weight models of every family, by (family, preset): what `diffusion-rl init-tiny` writes.

Each family's builder lives in models/tiny/<family>.py (named by its registration) with `PRESETS` and
`build(spec)`; the shared pieces in tiny/parts.py. A preset may also be a pretrained model shipped in the package
(tiny/shipped.py: sd3's `shapes`), copied out as it was made rather than built.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from diffusion_rl.errors import UserError
from diffusion_rl.models.registry import family_named, save_pipeline
from diffusion_rl.models.tiny.parts import build_seeded
from diffusion_rl.models.tiny.shipped import copy_shipped, load_shipped, shipped_dir, shipped_presets


def tiny_presets(family: str) -> list[str]:
    """The preset names of `family`'s tiny model: built ones, then shipped pretrained ones."""
    return [*importlib.import_module(family_named(family).tiny).PRESETS, *shipped_presets(family)]


def build_tiny(family: str = "sd3", preset: str = "base", seed: int = 0):
    """The tiny diffusers pipeline of `family` at `preset`, its random weights drawn from `seed` (the caller's
    global RNG is left as it was)."""
    if shipped_dir(family, preset) is not None:
        return load_shipped(family, preset)
    module = importlib.import_module(family_named(family).tiny)
    if preset not in module.PRESETS:
        raise UserError(f"the tiny {family} model has no preset '{preset}'; presets: {', '.join(tiny_presets(family))}")
    return build_seeded(module.build, module.PRESETS[preset], seed)


def save_tiny(directory: str | Path, family: str = "sd3", preset: str = "base", seed: int = 0) -> Path:
    """Write the tiny model of `family` in diffusers format to `directory`, laid out as a real checkpoint of the family
    (models/registry.py: save_pipeline), and return it."""
    directory = Path(directory)
    if shipped_dir(family, preset) is not None:
        return copy_shipped(family, preset, directory)
    save_pipeline(family, build_tiny(family, preset, seed), directory)
    return directory
