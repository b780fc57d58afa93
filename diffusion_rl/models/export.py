"""Trained weights in the forms diffusers users load: a LoRA folder for `load_lora_weights`, or a merged pipeline.

A LoRA folder holds the trained adapter twice: in peft's format (`adapter_model.safetensors` +
`adapter_config.json`, for `PeftModel.from_pretrained`) and in diffusers' (`pytorch_lora_weights.safetensors`,
with the LoRA config as metadata so that `pipeline.load_lora_weights(dir)` gets the alpha/rank scale right). Wan 2.2
A14B's second expert has a diffusers file of its own (`LORA_FILES`), which `load_lora_weights` puts into
`transformer_2` with `load_into_transformer_2=True`.
Every checkpoint has one (its `adapter/`); `diffusion-rl export` writes one anywhere.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from diffusion_rl.errors import UserError
from diffusion_rl.models.experts import pipeline_parts, tensors_by_part
from diffusion_rl.models.policies import DEFAULT
from diffusion_rl.models.registry import save_pipeline

logger = logging.getLogger(__name__)

DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"
# Wan 2.2 A14B's low-noise expert: `load_lora_weights(dir, weight_name=…, load_into_transformer_2=True)`
LORA_FILES = {"transformer": DIFFUSERS_LORA_FILE, "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}
_PEFT_PREFIX = "base_model.model."


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


def write_lora_adapter(model, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path | None:
    """Write the trained LoRA to `directory` in peft's format (adapter_model.safetensors + adapter_config.json) and
    in diffusers' (pytorch_lora_weights.safetensors, for the family's `pipeline.load_lora_weights(directory)`).

    `state_dict`: the peft model's LoRA parameters, whole, named as in its named_parameters() — for a model whose
    own parameters are sharded; None reads them from the model. Returns the diffusers file, or None without LoRA.
    """
    if model.policies.lora is None:
        return None
    from peft import get_peft_model_state_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    trained = model.policies.trained
    trained.save_pretrained(str(directory), selected_adapters=[DEFAULT], state_dict=state_dict)
    tensors = get_peft_model_state_dict(trained, state_dict=state_dict, adapter_name=DEFAULT)
    tensors = {n.removeprefix(_PEFT_PREFIX): t.detach().cpu().contiguous() for n, t in tensors.items()}
    for component, layers in tensors_by_part(trained.base_model.model, tensors).items():
        type(model.pipeline).save_lora_weights(
            directory,
            transformer_lora_layers=layers,
            transformer_lora_adapter_metadata=lora_metadata(model),
            weight_name=LORA_FILES[component],
        )
    return directory / DIFFUSERS_LORA_FILE


def merged_pipeline(model):
    """The model's diffusers pipeline with the trained weights in its transformer (LoRA merged into the base).

    Merging is in place: afterwards the model has no adapters left (no reference policy), so export last.
    """
    if model.policies.lora is not None:
        model.pipeline.register_modules(**pipeline_parts(model.policies.trained.merge_and_unload()))
    return model.pipeline


def export_merged(model, out: str | Path) -> Path:
    """Save the merged pipeline to `out` with save_pretrained (the same layout as the base model directory)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; export writes a model directory")
    save_pipeline(model.family, merged_pipeline(model), out)
    logger.info("wrote the merged %s model to %s", model.family, out)
    return out
