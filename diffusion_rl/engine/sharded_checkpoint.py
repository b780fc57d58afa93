"""Checkpoints of an FSDP2-sharded PolicyWorker with torch.distributed.checkpoint (DCP).

Inside a checkpoint directory (the trainer adds run_state.pt and config.yaml, and publishes the directory
atomically once every rank has returned):

    dcp/               what a resume loads: the named policies' weights, the optimizer state and the EMA, sharded
                       (DCP's .metadata and one file per rank). Loading reshards, so a run can resume on a different
                       number of workers.
    policy_<name>.safetensors, trainer_state.pt
                       as the local engine writes them, gathered by rank 0: the unsharded weights, the LR scheduler,
                       the EMA and the update counters (not the optimizer: that is in dcp/ only), for the
                       evaluation and export tools
    adapter/           LoRA only: the trained adapter gathered unsharded, as the local engine writes it: peft's
                       format (adapter_model.safetensors + adapter_config.json) and diffusers'
                       (pytorch_lora_weights.safetensors, for pipeline.load_lora_weights)

Every rank writes into the same directory, the one the driver passes: on several nodes, a shared filesystem.
Every function here is collective: all ranks call it together.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from diffusion_rl.errors import UserError
from diffusion_rl.models.policies import DEFAULT

logger = logging.getLogger(__name__)

DCP_DIR = "dcp"
TRAINER_STATE = "trainer_state.pt"
ADAPTER_DIR = "adapter"


def full_tensors(tensors: dict[str, torch.Tensor], keep: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded CPU copies: an all-gather per DTensor, in the dict's order (the same on every rank). With
    keep=False this rank takes part in the gathers but keeps nothing (only rank 0 needs a whole model in memory)."""
    out = {}
    for name, t in tensors.items():
        full = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        if keep:
            out[name] = full.cpu()
    return out


def _saved_policies(policies) -> list[str]:
    return [name for name in policies.names() if not name.startswith("__")]  # `__reference__` is rebuilt at load


def _state(worker, with_ema: bool = True) -> dict:
    """What DCP saves, or the tensors it loads into (sharded like this run's model)."""
    policies = worker.model.policies
    state = {
        "policies": {name: policies.state_dict_of(name) for name in _saved_policies(policies)},
        "optimizer": get_optimizer_state_dict(policies.trained, worker.optimizer),
    }
    if worker.ema is not None and with_ema:
        names = [n for n, p in policies.trained.named_parameters() if p.requires_grad]  # trainable_parameters' order
        state["ema"] = dict(zip(names, worker.ema.shadow))
    return state


def save(worker, directory: Path, rank: int) -> None:
    dcp.save(_state(worker), checkpoint_id=directory / DCP_DIR)
    # also unsharded, as the local engine writes them: the evaluation and export tools read these files
    policies = worker.model.policies
    weights = {name: full_tensors(policies.state_dict_of(name), rank == 0) for name in _saved_policies(policies)}
    ema = None
    if worker.ema is not None:
        shadow = full_tensors({str(i): s for i, s in enumerate(worker.ema.shadow)}, rank == 0)
        ema = {"decay": worker.ema.decay, "shadow": list(shadow.values())}
    export_lora(worker, directory / ADAPTER_DIR, rank)
    if rank != 0:
        return
    for name, tensors in weights.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, directory / f"policy_{name}.safetensors")
    torch.save(
        {
            "scheduler": worker.scheduler.state_dict(),
            "ema": ema,
            "counters": [worker.optimizer_steps, worker.skipped_updates, worker.consecutive_skips],
            "engine": "ray",  # the optimizer state is in dcp/ only, sharded
            "world_size": worker.parallel.world_size,
        },
        directory / TRAINER_STATE,
    )


def load(worker, directory: Path) -> None:
    if not (directory / DCP_DIR).is_dir():
        raise UserError(
            f"{directory} has no {DCP_DIR}/ folder: it was written by the local engine; resume it with "
            "engine.kind=local (checkpoints of engine.kind=ray resume with any engine.num_workers)"
        )
    saved_keys = dcp.FileSystemReader(directory / DCP_DIR).read_metadata().state_dict_metadata
    has_ema = any(key.startswith("ema.") for key in saved_keys)
    if worker.ema is not None and not has_ema:
        logger.warning("%s holds no EMA weights: the EMA restarts from the current weights", directory)
    state = _state(worker, with_ema=has_ema)
    dcp.load(state, checkpoint_id=directory / DCP_DIR)  # into this run's shards, whatever the saved sharding
    policies = worker.model.policies
    for name, tensors in state["policies"].items():
        policies.load_state_dict_of(name, tensors)
    set_optimizer_state_dict(policies.trained, worker.optimizer, state["optimizer"])
    trainer = torch.load(directory / TRAINER_STATE, map_location="cpu", weights_only=False)
    worker.scheduler.load_state_dict(trainer["scheduler"])
    worker.optimizer_steps, worker.skipped_updates, worker.consecutive_skips = trainer["counters"]
    if trainer["world_size"] != worker.parallel.world_size:
        logger.info("resharded %s from %d to %d workers", directory, trainer["world_size"], worker.parallel.world_size)


def export_lora(worker, out: Path, rank: int) -> None:
    """The trained LoRA adapter, unsharded, in peft's format (rank 0 writes it; every rank gathers)."""
    policies = worker.model.policies
    if policies.lora is None:
        return
    trained = policies.trained
    tag = f".{DEFAULT}."
    full = full_tensors({n: p for n, p in trained.named_parameters() if "lora_" in n and tag in n}, rank == 0)
    if rank != 0:
        return
    from peft import get_peft_model_state_dict

    from diffusion_rl.models.export import DIFFUSERS_LORA_FILE, lora_metadata

    # the same two forms the local engine writes (models/export.py), from the gathered tensors
    trained.save_pretrained(str(out), selected_adapters=[DEFAULT], state_dict=full)
    weights = get_peft_model_state_dict(trained, state_dict=full, adapter_name=DEFAULT)
    model = worker.model
    type(model.pipeline).save_lora_weights(
        out,
        transformer_lora_layers={n.removeprefix("base_model.model."): t.contiguous() for n, t in weights.items()},
        transformer_lora_adapter_metadata=lora_metadata(model),
        weight_name=DIFFUSERS_LORA_FILE,
    )
