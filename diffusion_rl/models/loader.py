"""Load a FlowModel from a local diffusers-format directory; the family comes from model_index.json."""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import torch

from diffusion_rl.errors import UserError
from diffusion_rl.models.base import FlowModel
from diffusion_rl.models.load_errors import raise_if_damaged
from diffusion_rl.models.policies import LoraSettings
from diffusion_rl.models.quiet import quiet_loading, quiet_prompt_truncation

logger = logging.getLogger(__name__)

# diffusers pipeline class (model_index.json "_class_name") → our family name
PIPELINE_FAMILIES = {"StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux", "QwenImagePipeline": "qwen_image"}
# family → (the diffusers pipeline class that loads it, our adapter as "module:Class")
FAMILY_CLASSES = {
    "sd3": ("StableDiffusion3Pipeline", "diffusion_rl.models.sd3:SD3Model"),
    "flux": ("FluxPipeline", "diffusion_rl.models.flux:FluxModel"),
    "qwen_image": ("QwenImagePipeline", "diffusion_rl.models.qwen_image:QwenImageModel"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def detect_family(path: Path) -> str:
    index = path / "model_index.json"
    if not path.exists():
        raise UserError(
            f"model directory '{path}' does not exist (create the tiny one with `diffusion-rl init-tiny {path}`)"
        )
    if not path.is_dir():
        raise UserError(f"model path '{path}' is a file; point model.path at a diffusers model directory")
    if not index.is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
        raise UserError(
            f"'{path}' is not a diffusers model directory: no model_index.json (found: {found}). "
            "Point model.path at a directory saved with `save_pretrained` or downloaded from the hub."
        )
    try:
        class_name = json.loads(index.read_text())["_class_name"]
    except (json.JSONDecodeError, KeyError) as e:
        raise UserError(f"{index}: cannot read the pipeline class ({e})") from e
    if class_name not in PIPELINE_FAMILIES:
        raise UserError(
            f"{index}: pipeline '{class_name}' is not supported; supported: {', '.join(sorted(PIPELINE_FAMILIES))}"
        )
    return PIPELINE_FAMILIES[class_name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"model.device={name} but no CUDA device is available; use model.device=cpu")
    return torch.device(name)


def load_model(cfg) -> FlowModel:
    """Build the FlowModel for a `ModelConfig` (see diffusion_rl.config)."""
    path = Path(cfg.path).expanduser()
    family = cfg.family if cfg.family != "auto" else detect_family(path)
    if cfg.family != "auto" and detect_family(path) != family:  # also fails early and clearly on a bad directory
        raise UserError(
            f"model.family={family} but {path / 'model_index.json'} holds a {detect_family(path)} pipeline; "
            f"set model.family=auto or point model.path at a {family} model"
        )
    if family not in FAMILY_CLASSES:  # pragma: no cover - the config's Literal only allows known names
        raise UserError(f"unknown model family '{family}'; known: {', '.join(FAMILY_CLASSES)}")
    device, dtype = resolve_device(cfg.device), DTYPES[cfg.dtype]
    import diffusers

    pipeline_name, adapter = FAMILY_CLASSES[family]
    module_name, class_name = adapter.split(":")
    model_cls = getattr(importlib.import_module(module_name), class_name)
    try:
        with quiet_loading():  # no progress bars or info logs, in every process (Ray workers too)
            pipeline = getattr(diffusers, pipeline_name).from_pretrained(path, dtype=dtype)
    except Exception as e:  # a truncated file, a component without config.json: one line naming the file
        raise_if_damaged(path, e)
        raise
    quiet_prompt_truncation(pipeline)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.to(device)
    lora = None
    if cfg.lora.enabled:
        targets = tuple(cfg.lora.target_modules) or model_cls.default_lora_targets
        lora = LoraSettings(rank=cfg.lora.rank, alpha=cfg.lora.alpha, target_modules=targets)
    try:
        model = model_cls(
            pipeline,
            lora=lora,
            device=device,
            dtype=dtype,
            max_sequence_length=cfg.max_sequence_length,
            gradient_checkpointing=cfg.gradient_checkpointing,
        )
    except ValueError as e:
        if lora is None or not cfg.lora.target_modules:
            raise
        targets = list(cfg.lora.target_modules)
        raise UserError(f"model.lora.target_modules={targets} do not fit this {family} model: {e}") from None
    model.policies.compile_sampling = getattr(cfg, "compile", False)
    n_train = sum(p.numel() for p in model.trainable_parameters())
    logger.info(
        "loaded %s model from %s (%s, %s): %.2fM trainable parameters", family, path, cfg.dtype, device, n_train / 1e6
    )
    return model
