"""Trained weights in the forms diffusers users load: a LoRA file for `load_lora_weights`, or a merged pipeline.

A checkpoint's `adapter/` folder holds the trained LoRA twice: in peft's format (`adapter_model.safetensors` +
`adapter_config.json`, for `PeftModel.from_pretrained`) and in diffusers' (`pytorch_lora_weights.safetensors`,
with the LoRA config as metadata so that `pipeline.load_lora_weights(dir)` gets the alpha/rank scale right).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from diffusion_rl.errors import UserError
from diffusion_rl.models.policies import DEFAULT

logger = logging.getLogger(__name__)

DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"
_PEFT_PREFIX = "base_model.model."


def lora_state_dict(model) -> dict[str, torch.Tensor]:
    """The trained LoRA tensors named as in the bare transformer (`transformer_blocks.0.attn.to_q.lora_A.weight`)."""
    from peft import get_peft_model_state_dict

    tensors = get_peft_model_state_dict(model.policies.trained, adapter_name=DEFAULT)
    return {name.removeprefix(_PEFT_PREFIX): t.detach().cpu().contiguous() for name, t in tensors.items()}


def lora_metadata(model) -> dict:
    """The adapter's LoraConfig as JSON-safe values (diffusers rebuilds the LoRA layers, alpha included, from it)."""
    config = model.policies.trained.peft_config[DEFAULT].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    return {k: v for k, v in config.items() if _json_safe(v)}


def _json_safe(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def save_diffusers_lora(model, directory: str | Path) -> Path | None:
    """Write the LoRA as `directory/pytorch_lora_weights.safetensors` for the family's `load_lora_weights`.

    Returns the file, or None when the model trains no LoRA (full fine-tuning).
    """
    if model.policies.lora is None:
        return None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    type(model.pipeline).save_lora_weights(
        directory,
        transformer_lora_layers=lora_state_dict(model),
        transformer_lora_adapter_metadata=lora_metadata(model),
        weight_name=DIFFUSERS_LORA_FILE,
    )
    return directory / DIFFUSERS_LORA_FILE


def merged_pipeline(model):
    """The model's diffusers pipeline with the trained weights in its transformer (LoRA merged into the base).

    Merging is in place: afterwards the model has no adapters left (no reference policy), so export last.
    """
    if model.policies.lora is not None:
        model.pipeline.transformer = model.policies.trained.merge_and_unload()
    return model.pipeline


def export_merged(model, out: str | Path) -> Path:
    """Save the merged pipeline to `out` with save_pretrained (the same layout as the base model directory)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; export writes a model directory")
    pipeline = merged_pipeline(model)
    pipeline.save_pretrained(out)
    logger.info("wrote the merged %s model to %s", model.family, out)
    return out


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
    The LoRA settings come from the checkpoint's config.yaml; `model_path` (default: the run's model.path),
    `dtype` and `max_sequence_length` override the run's. Returns (model, checkpoint directory, "ema"|"trained").
    """
    from diffusion_rl.evaluation.targets import resolve_checkpoint
    from diffusion_rl.models.checkpoint_weights import checkpoint_model_config, load_trained_weights
    from diffusion_rl.models.loader import load_model

    directory = resolve_checkpoint(checkpoint)
    overrides: dict = {"device": device, "create_tiny_if_missing": None}
    if model_path is not None:
        overrides["path"] = model_path
    if dtype is not None:
        overrides["dtype"] = dtype
    if max_sequence_length is not None:
        overrides["max_sequence_length"] = max_sequence_length
    model = load_model(checkpoint_model_config(directory, **overrides))
    which = load_trained_weights(model, directory, use_ema=use_ema)
    logger.info("applied the %s weights of %s", which, directory)
    return model, directory, which
