"""Load a FlowModel from a diffusers-format directory (a local one, or a Hub repository's snapshot: models/hub.py); the
family comes from model_index.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from diffusion_rl.config.model import device_problem
from diffusion_rl.errors import UserError
from diffusion_rl.models.attention import DEFAULT_BACKEND, set_attention_backend
from diffusion_rl.models.base import FlowModel, freeze
from diffusion_rl.models.compiling import compile_blocks_on
from diffusion_rl.models.hub import model_dir
from diffusion_rl.models.load_errors import raise_if_bad_index, raise_if_damaged, refuse_unused_weights
from diffusion_rl.models.policies import LoraSettings
from diffusion_rl.models.quiet import quiet_loading, quiet_prompt_truncation
from diffusion_rl.models.registry import family_named, family_of_pipeline
from diffusion_rl.utils.dtypes import DTYPES

logger = logging.getLogger(__name__)


def detect_family(path: Path) -> str:
    return detect_pipeline(path)[0]


def detect_pipeline(path: Path) -> tuple[str, str]:
    """(family, diffusers pipeline class) of the model directory `path`, from its model_index.json."""
    index = path / "model_index.json"
    if not path.exists():
        raise UserError(
            f"model directory '{path}' does not exist (create the tiny one with `diffusion-rl init-tiny {path}`)"
        )
    if not path.is_dir():
        raise UserError(
            f"model path '{path}' is a file; point model.path (a command's --model) at a diffusers model directory"
        )
    if not index.is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
        raise UserError(
            f"'{path}' is not a diffusers model directory: no model_index.json (found: {found}). "
            "Point model.path (a command's --model) at a directory saved with `save_pretrained` or downloaded from the "
            "hub."
        )
    try:
        class_name = json.loads(index.read_text())["_class_name"]
    except (ValueError, KeyError, TypeError) as e:  # not JSON, not an object, no class
        raise UserError(f"{index}: cannot read the pipeline class ({e})") from e
    return family_of_pipeline(class_name, str(index)).name, class_name


def resolve_device(name: str) -> torch.device:
    """The torch device model.device names, or a UserError when it is no device or one this machine lacks."""
    problem = device_problem(name)
    if problem is not None:
        raise UserError(f"model.device {problem}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"model.device={name} but no CUDA device is available; use model.device=cpu")
    if device.type == "cuda" and device.index is not None and device.index >= (count := torch.cuda.device_count()):
        have = "1 CUDA device (cuda:0)" if count == 1 else f"{count} CUDA devices (cuda:0 to cuda:{count - 1})"
        raise UserError(f"model.device={name} but this machine has {have}")
    return device


def text_encoder_names(path: Path) -> list[str]:
    """The pipeline's text encoders (text_encoder, text_encoder_2, …), as its model_index.json names them."""
    index = json.loads((Path(path) / "model_index.json").read_text())
    return [name for name in index if name.startswith("text_encoder")]


def load_text_encoders(model: FlowModel, path: str | Path) -> None:
    """Load the text encoders `load_model(..., text_encoders=False)` left out into the model's pipeline: frozen, in the
    model's dtype, on its device (on the CPU with offload_frozen)."""
    import transformers

    path = Path(path).expanduser()
    index = json.loads((path / "model_index.json").read_text())
    with torch.random.fork_rng(devices=[]), quiet_loading():  # loading must not move the run's RNG stream
        for name in text_encoder_names(path):
            library, class_name = index[name]
            if library != "transformers":
                raise UserError(f"{path / 'model_index.json'}: text encoder {name} of {library}, not transformers")
            try:
                encoder = getattr(transformers, class_name).from_pretrained(path / name, dtype=model.dtype)
            except Exception as e:
                raise_if_damaged(path, e)
                raise
            freeze(encoder)
            # with model.offload_frozen the encoders live on the CPU and move to the device for each encode
            setattr(model.pipeline, name, encoder.to("cpu" if model.offload_frozen else model.device))
    logger.info("loaded the text encoders of %s", path)


def resolve_pipeline(path: Path, family: str) -> tuple[str, str]:
    """(family, diffusers pipeline class) that load the model directory `path` under model.family `family`
    (`family_for`'s rule on what its model_index.json names)."""
    detected, pipeline_class = detect_pipeline(path)
    return family_for(detected, pipeline_class, family, str(path / "model_index.json"))


def family_for(detected: str, pipeline_class: str, family: str, where: str) -> tuple[str, str]:
    """(family, pipeline class) that load a `detected` family's checkpoint (`where` holds it) under model.family
    `family`: auto, the detected one; a family that reads another's checkpoints too (models/registry.py:
    `loads_also`) when the user chose it; UserError when it names another family."""
    chosen = family_named(family) if family != "auto" else None
    if chosen is not None and chosen.name != detected and pipeline_class in chosen.loads_also:
        return chosen.name, chosen.pipeline
    if family not in ("auto", detected):
        raise UserError(
            f"model.family={family} but {where} holds a {detected} pipeline; "
            f"set model.family=auto or point model.path at a {family} model"
        )
    return detected, pipeline_class


def load_model(cfg, *, text_encoders: bool = True) -> FlowModel:
    """Build the FlowModel for a `ModelConfig` (see diffusion_rl.config). `text_encoders=False`: without them (the
    prompt-embedding cache may need none; `load_text_encoders` adds them later)."""
    path = model_dir(cfg.path, getattr(cfg, "revision", None))  # a folder, or a Hub id's snapshot in the cache
    name, pipeline_class = resolve_pipeline(path, cfg.family)  # also fails early and clearly on a bad directory
    family = family_named(name)
    raise_if_bad_index(path)  # before diffusers looks up the module a component names
    device, dtype = resolve_device(cfg.device), DTYPES[cfg.dtype]
    import diffusers

    try:
        with quiet_loading():  # no progress bars or info logs, in every process (Ray workers too)
            given = family.components(path) if family.components is not None else {}
            # diffusers checks a passed component against the class model_index.json names, which transformers may
            # not build here (FLUX.2-dev's PixtralProcessor without torchvision): load without them, then set them
            held = dict.fromkeys(given)
            if not text_encoders:
                held.update({name: None for name in text_encoder_names(path)})
            pipeline = getattr(diffusers, pipeline_class).from_pretrained(path, dtype=dtype, **held)
            pipeline.register_modules(**given)
    except Exception as e:  # a truncated file, a component without config.json: one line naming the file
        raise_if_damaged(path, e)
        raise
    refuse_unused_weights(path, pipeline)
    model = model_of_pipeline(pipeline, family, cfg, device, dtype, str(path))
    model.directory = path
    return model


def model_of_pipeline(pipeline, family, cfg, device: torch.device, dtype: torch.dtype, source: str) -> FlowModel:
    """The FlowModel of a built diffusers `pipeline` of `family` as a `ModelConfig` asks (attention backend, device
    placement, LoRA, checkpointing, compilation, autocast); `source` names where it came from in the log."""
    quiet_prompt_truncation(pipeline)
    # before the policies exist: full fine-tuning's copies inherit the backend
    for transformer in (pipeline.transformer, getattr(pipeline, "transformer_2", None)):  # Wan 2.2 A14B: two
        if transformer is not None:
            set_attention_backend(transformer, getattr(cfg, "attention_backend", DEFAULT_BACKEND), family.name, device)
    pipeline.set_progress_bar_config(disable=True)
    offload = getattr(cfg, "offload_frozen", False)
    if offload:  # the frozen components stay on the CPU: they never occupy the device all at once, even while loading
        for name, component in pipeline.components.items():
            if isinstance(component, torch.nn.Module) and name not in family.adapter.frozen_components:
                component.to(device)
    else:
        pipeline.to(device)
    lora = None
    if cfg.lora.enabled:
        targets = tuple(cfg.lora.target_modules) or family.lora_targets
        lora = LoraSettings(rank=cfg.lora.rank, alpha=cfg.lora.alpha, target_modules=targets)
    try:
        model = family.adapter(
            pipeline,
            lora=lora,
            device=device,
            dtype=dtype,
            max_sequence_length=cfg.max_sequence_length,
            # auto is resolved to a count before a trainer loads (trainer/setup.py); other commands do not train
            gradient_checkpointing=False if cfg.gradient_checkpointing == "auto" else cfg.gradient_checkpointing,
            offload_frozen=offload,
        )
    except ValueError as e:
        if lora is None or not cfg.lora.target_modules:
            raise
        targets = list(cfg.lora.target_modules)
        raise UserError(f"model.lora.target_modules={targets} do not fit this {family.name} model: {e}") from None
    model.condition_sizing = getattr(cfg, "condition_size", "output")
    model.policies.compile_sampling = getattr(cfg, "compile", False)
    model.policies.compile_blocks = compile_blocks_on(cfg, device)
    model.policies.autocast = None if getattr(cfg, "autocast", "none") == "none" else DTYPES[cfg.autocast]
    model.policies.offload_reference_to = device if getattr(cfg, "offload_reference", False) else None
    n_train = sum(p.numel() for p in model.trainable_parameters())
    logger.info(
        "loaded %s model from %s (%s, %s): %.2fM trainable parameters",
        family.name,
        source,
        cfg.dtype,
        device,
        n_train / 1e6,
    )
    return model
