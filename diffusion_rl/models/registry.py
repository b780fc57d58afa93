"""The model families, each registered once, in its adapter's file (models/families/<name>.py).

A family ties together what the rest of the code must know about it: its name (`model.family`, `init-tiny
--family`), the diffusers pipeline class a model directory's model_index.json names, our `FlowModel` adapter,
its tiny random-weight builder (models/tiny/<name>.py: `PRESETS` and `build`) and its LoRA target preset. Adding
a family is its adapter file (with the registration) and its tiny-builder file; nothing else spells its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diffusion_rl.config.plugins import FAMILIES
from diffusion_rl.errors import UserError
from diffusion_rl.registry import Registry


@dataclass(frozen=True)
class ModelFamily:
    name: str
    pipeline: str  # the diffusers pipeline class (model_index.json's "_class_name") that loads it
    adapter: type  # the FlowModel subclass that wraps the pipeline
    tiny: str  # module of the tiny builder: PRESETS {name: spec} and build(spec) -> pipeline
    lora_targets: tuple[str, ...]  # module names LoRA adapts when model.lora.target_modules is empty
    # pipeline components the loader builds itself from the model directory and hands to from_pretrained (by name),
    # e.g. Qwen-Image-Edit's processor, which transformers builds only with torchvision; None: diffusers loads all
    components: Callable[[Path], dict] | None = None
    # how a pipeline of the family is written (tiny models, merged exports) when save_pretrained alone would not
    # lay it out as a real checkpoint; None: save_pretrained
    save: Callable[[object, Path], None] | None = None
    # pipeline classes of other families whose directories this family also loads when model.family names it (Wan
    # 2.2 TI2V-5B's WanPipeline checkpoint is an image-to-video model too)
    loads_also: tuple[str, ...] = ()
    # other pipeline classes whose checkpoints this family loads (FLUX.2-dev's Flux2Pipeline beside klein's)
    variants: tuple[str, ...] = ()
    # what it makes, as the Hugging Face Hub's pipeline_tag names it (a model card's front matter)
    task: str = "text-to-image"


def register_family(family: ModelFamily) -> None:
    """Register `family`; its adapter class learns its name (`FlowModel.family`), however a model is built."""
    FAMILIES.register(family.name)(family)
    family.adapter.family = family.name


def load_families() -> Registry[ModelFamily]:
    """The registry of families (every module of models/families/ is imported on its first look-up)."""
    return FAMILIES


def family_named(name: str) -> ModelFamily:
    return load_families().get(name)


def save_pipeline(family: str, pipeline, directory: Path) -> None:
    """Write a pipeline of `family` to `directory` as a real checkpoint of that family is laid out."""
    save = family_named(family).save
    if save is None:
        pipeline.save_pretrained(directory)
    else:
        save(pipeline, Path(directory))


def family_of_pipeline(class_name: str, where: str) -> ModelFamily:
    """The family whose pipeline class is `class_name` (read from `where`, named in the error)."""
    for _, family in FAMILIES.items():
        if class_name in (family.pipeline, *family.variants):
            return family
    known = [f"{f.pipeline} ({name})" for name, f in FAMILIES.items()]
    known += [f"{variant} ({name})" for name, f in FAMILIES.items() for variant in f.variants]
    known = ", ".join(known)
    raise UserError(f"{where}: pipeline '{class_name}' is not supported; supported: {known}")
