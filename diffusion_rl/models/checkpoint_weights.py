"""Apply a training checkpoint's weights to a freshly loaded model, for sampling and evaluation.

A checkpoint directory (see trainer/checkpoint.py) holds `policy_default.safetensors` (the LoRA tensors, or the
whole transformer under full fine-tuning), `trainer_state.pt` (optimizer, and the EMA shadow when the run kept
one) and the run's `config.yaml`. LoRA tensors only fit a model built with the same LoRA settings, so the
model config to load comes from that `config.yaml` (`checkpoint_model_config`).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffusion_rl.errors import UserError

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "policy_default.safetensors"
CONFIG_FILE = "config.yaml"
TRAINER_STATE_FILE = "trainer_state.pt"


def checkpoint_config(checkpoint_dir: str | Path):
    """The run config saved with a checkpoint (a `diffusion_rl.config.Config`)."""
    from diffusion_rl.config import load

    path = Path(checkpoint_dir) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"checkpoint {checkpoint_dir} has no {CONFIG_FILE}; was it written by `diffusion-rl train`?")
    return load(str(path))


def checkpoint_model_config(checkpoint_dir: str | Path, **overrides):
    """The `ModelConfig` the checkpoint was trained with (LoRA settings included), with `overrides` applied."""
    import dataclasses

    model = checkpoint_config(checkpoint_dir).model
    return dataclasses.replace(model, **overrides)


def weights_sha256(checkpoint_dir: str | Path) -> str:
    """sha256 of the checkpoint's trained weights file: identifies the weights whatever the directory is called."""
    digest = hashlib.sha256()
    with open(Path(checkpoint_dir) / WEIGHTS_FILE, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def has_ema(checkpoint_dir: str | Path) -> bool:
    """Whether the run kept an EMA of the trained weights (train.ema.enabled), which validation samples with."""
    return checkpoint_config(checkpoint_dir).train.ema.enabled


@torch.no_grad()
def load_trained_weights(model, checkpoint_dir: str | Path, use_ema: bool = True) -> str:
    """Load the checkpoint's trained policy into `model` (built with `checkpoint_model_config`).

    With `use_ema` and a run that kept an EMA, the EMA weights replace the trained ones, as validation does.
    Returns "ema" or "trained": which weights are now in the model.
    """
    directory = Path(checkpoint_dir)
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise UserError(f"checkpoint {directory} has no {WEIGHTS_FILE}; is it a step_NNNNNN checkpoint directory?")
    try:
        model.policies.load_state_dict_of("default", load_file(path, device=str(model.device)))
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    if not (use_ema and has_ema(directory)):
        return "trained"
    state = torch.load(directory / TRAINER_STATE_FILE, map_location="cpu", weights_only=False)
    if state.get("ema") is None:
        logger.warning(
            "%s: the run had train.ema.enabled but the checkpoint holds no EMA; using the trained weights", directory
        )
        return "trained"
    params = model.trainable_parameters()
    shadow = state["ema"]["shadow"]
    if len(shadow) != len(params) or any(s.shape != p.shape for s, p in zip(shadow, params)):
        raise UserError(f"{directory}: the EMA weights do not match this model's trainable parameters")
    for p, s in zip(params, shadow):
        p.copy_(s.to(p.device, p.dtype))
    return "ema"
