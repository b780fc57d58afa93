"""A training checkpoint's weights on a freshly loaded model, for `sample`, `eval` and `export`.

The model comes from the checkpoint's config.yaml (LoRA tensors only fit a model built with the same LoRA
settings); its trained policy — or, when the run kept one, the EMA of it, as validation samples with — is read
from the checkpoint's dcp/ (checkpoint/state.py), whatever engine and worker count wrote it. Both are read only once the
checkpoint matches its manifest (checkpoint/manifest.py).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from diffusion_rl.checkpoint.manifest import verify_checkpoint
from diffusion_rl.checkpoint.paths import resolve_checkpoint
from diffusion_rl.checkpoint.state import CONFIG_FILE, check_format, load_tensors, saved_keys
from diffusion_rl.errors import UserError
from diffusion_rl.user_code import refusing_user_code
from diffusion_rl.utils.digest import weights_digest

logger = logging.getLogger(__name__)


def checkpoint_config(checkpoint_dir: str | Path):
    """The run config saved with a checkpoint (a `diffusion_rl.config.Config`), once the checkpoint is verified."""
    from diffusion_rl.config import load

    verify_checkpoint(checkpoint_dir)
    path = Path(checkpoint_dir) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"checkpoint {checkpoint_dir} has no {CONFIG_FILE}; was it written by `diffusion-rl train`?")
    with refusing_user_code(f"the {CONFIG_FILE} of checkpoint {checkpoint_dir}"):
        return load(str(path))  # a user loss it names stays a name: sample, eval and export never import it


def validation_sampling(cfg) -> dict:
    """How a run (its `Config`) sampled its validation images — steps, guidance (and the low-noise expert's), height,
    width, frames: what `sample --checkpoint` uses unless told otherwise."""
    height, width = cfg.val.size(cfg.sampling)
    guidance, low_noise = cfg.val.guidance_scales(cfg.sampling)
    return {"steps": cfg.val.num_steps, "guidance": guidance, "guidance_low_noise": low_noise, "height": height,
            "width": width, "frames": cfg.sampling.num_frames}  # fmt: skip


def checkpoint_model_config(checkpoint_dir: str | Path, **overrides):
    """The `ModelConfig` the checkpoint was trained with (LoRA settings included), with `overrides` applied."""
    return dataclasses.replace(checkpoint_config(checkpoint_dir).model, **overrides)


def has_ema(checkpoint_dir: str | Path) -> bool:
    """Whether the checkpoint holds an EMA of the trained weights (train.ema.enabled), which validation uses."""
    return any(key.startswith("ema.") for key in saved_keys(Path(checkpoint_dir)))


@torch.no_grad()
def load_trained_weights(model, checkpoint_dir: str | Path, use_ema: bool = True) -> tuple[str, str]:
    """Load the checkpoint's trained policy into `model` (built with `checkpoint_model_config`); with `use_ema`
    and a checkpoint that holds an EMA, the EMA weights replace the trained ones, as validation does.

    Returns ("ema" | "trained": which weights are now in the model, the digest of the trained weights).
    """
    directory = Path(checkpoint_dir)
    verify_checkpoint(directory)  # hashed once: checkpoint_config verified it already when it built `model`
    check_format(directory)
    policies = model.policies
    tensors = {"policies": {"default": policies.state_dict_of("default")}}
    ema = use_ema and has_ema(directory)
    if ema:
        names = policies.trainable_names()
        tensors["ema"] = {n: p.detach().clone() for n, p in zip(names, policies.trainable_parameters())}
    try:
        load_tensors(tensors, directory)
        policies.load_state_dict_of("default", tensors["policies"]["default"])
    except (RuntimeError, ValueError) as e:  # DCP's CheckpointException is a RuntimeError
        raise UserError(
            f"{directory}: its weights do not fit this model — was it made with the same model and LoRA settings? "
            f"({str(e).strip().splitlines()[0][:300]})"
        ) from None
    digest = weights_digest(tensors["policies"]["default"])
    if not ema:
        return "trained", digest
    for p, s in zip(policies.trainable_parameters(), tensors["ema"].values()):
        p.copy_(s.to(p.device, p.dtype))
    return "ema", digest


def load_checkpoint_model(
    checkpoint: str,
    model_path: str | None = None,
    *,
    device: str = "auto",
    dtype: str | None = None,
    max_sequence_length: int | None = None,
    use_ema: bool = True,
):
    """The model a training checkpoint describes, with its trained (or EMA) weights applied.

    `checkpoint`: a step_NNNNNN directory, a run directory (its latest checkpoint) or its checkpoints/ folder.
    The LoRA settings and the text length come from the checkpoint's config.yaml; `model_path` (default: the run's
    model.path), `dtype` and `max_sequence_length` override the run's. Returns (model, checkpoint directory,
    "ema"|"trained").
    """
    from diffusion_rl.models.loader import load_model

    directory = resolve_checkpoint(checkpoint)
    overrides: dict = {"device": device, "create_tiny_if_missing": None}
    if model_path is not None:  # another base model: the run's model.revision was the run's model's
        overrides |= {"path": model_path, "revision": None}
    if dtype is not None:
        overrides["dtype"] = dtype
    if max_sequence_length is not None:
        overrides["max_sequence_length"] = max_sequence_length
    model = load_model(checkpoint_model_config(directory, **overrides))
    which, _ = load_trained_weights(model, directory, use_ema=use_ema)
    logger.info("applied the %s weights of %s", which, directory)
    return model, directory, which
