"""The `encoders` part: the frozen text encoders at real size, through the model's own `encode_prompts`.

The model parts run no text encoders (random embeddings stand in), so what a run holds and spends on them — 10–17 GiB
of the ready configs' peaks, and the host-device copies `model.offload_frozen` makes each step — had never been
measured. This part builds SD3.5-Medium's three (CLIP-L, CLIP-G, T5-XXL: 5.6 B parameters) and Wan 2.1's UMT5-XXL
(5.7 B) at real size with random weights: each the transformers class of the family's tiny pipeline, its config
overlaid with the shipped architecture's (diffusion_rl/assets/architectures), born on the device in the run's dtype.
Both read their text padded to a fixed length (77 CLIP tokens, model.max_sequence_length T5 tokens), so the tiny
pipeline's tokenizers give the real token counts. The transformer and the VAE are the tiny pipeline's: only
`encode_prompts` runs. For each model, with the encoders held on the device and then with `model.offload_frozen`
(on the CPU, moved to the device for the call and back): a warm-up call and a measured one over one step's prompts
on a GPU of the ready config; seconds, the encoders' GiB on the device, the call's peak above them, and `estimate`'s
`text_encoders` GiB and `encode_prompts` seconds for the same config beside them. The dry run does the same with the
tiny encoders.
"""

from __future__ import annotations

import math
import time

import torch

from diffusion_rl.config import load
from diffusion_rl.estimate.architectures import shipped_doc
from diffusion_rl.estimate.estimator import estimate
from diffusion_rl.models.loader import model_of_pipeline, resolve_device
from diffusion_rl.models.registry import family_named
from diffusion_rl.models.tiny import build_tiny
from diffusion_rl.utils.dtypes import DTYPES

from .parts import (
    GIB,
    PROMPT_TOKENS,
    ROOT,
    RUNS,
    Context,
    architecture,
    cuda_in_use,
    release,
    reset_peaks,
    run_config,
    sync,
)

MODELS = ("sd35_lora", "wan21_lora")  # the model parts' runs whose encoders read padded text
GPUS = 8  # the ready configs' workers: one step's prompts per GPU are prompts_per_step / 8 and the negative


def shipped_text_configs(name: str) -> dict[str, dict]:
    """The text encoders' configs of shipped architecture `name`."""
    return {k: v for k, v in shipped_doc(name)["components"].items() if k.startswith("text_encoder")}


def born_text_encoder(tiny: torch.nn.Module, shipped_config: dict, device: torch.device, dtype: torch.dtype):
    """`tiny`'s transformers class at the shipped config's size (empty: the tiny size), random weights, built on
    `device` in `dtype` (never in fp32 on the CPU first), frozen."""
    config = tiny.config
    if shipped_config:  # the class's defaults under the shipped keys (T5's gating is derived from feed_forward_proj)
        keys = {k: v for k, v in shipped_config.items() if k not in ("model_type", "_class_name")}
        if hasattr(config, "projection_dim"):  # SD3's CLIPs project to their own width (768, 1280)
            keys["projection_dim"] = keys["hidden_size"]
        config = type(config)(**keys)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            module = type(tiny)(config)
    finally:
        torch.set_default_dtype(previous)
    return module.eval().requires_grad_(False)


def model_with_real_encoders(ctx: Context, name: str, offload: bool):
    """The run's FlowModel on the tiny pipeline with its text encoders replaced by real-size random ones."""
    run = RUNS[name]
    cfg = run_config(ctx, run, [f"model.offload_frozen={str(offload).lower()}"])
    device, dtype = resolve_device(cfg.model.device), DTYPES[cfg.model.dtype]
    pipeline = build_tiny(run.family, run.preset)
    configs = {} if ctx.dry_run else shipped_text_configs(run.arch)
    components = dict(pipeline.components)
    for component in [k for k, v in components.items() if k.startswith("text_encoder") and v is not None]:
        components[component] = born_text_encoder(components[component], configs.get(component, {}), device, dtype)
    settings = {k: v for k, v in pipeline.config.items() if not k.startswith("_") and k not in components}
    family = family_named(run.family)
    model = model_of_pipeline(type(pipeline)(**components, **settings), family, cfg.model, device, dtype,
                              f"{run.arch} text encoders")  # fmt: skip
    return cfg, model


def ready_config(run):
    """The ready config as shipped (the check's run config has one prompt per step)."""
    return load(ROOT / "configs" / run.config, list(run.overrides))


def encoders_variant(ctx: Context, name: str, offload: bool, count: int) -> dict:
    """One model's encoders held on the device (offload False) or moved for the call (True): a warm-up call, then one
    over `count` prompts, what one GPU of the ready config encodes each step (the negative is the model's own)."""
    cfg, model = model_with_real_encoders(ctx, name, offload)
    encoders = [m for k, m in model.pipeline.components.items() if k.startswith("text_encoder") and m is not None]
    weights = sum(p.numel() * p.element_size() for m in encoders for p in m.parameters()) / GIB
    prompts = [f"prompt {i}: a red cube to the left of a blue sphere on a wooden table" for i in range(count)]
    model.encode_prompts(prompts[:1])  # warm-up: kernels, the allocator's first blocks, the first move
    sync()
    reset_peaks()
    before = torch.cuda.memory_allocated() / GIB if cuda_in_use() else None
    started = time.perf_counter()
    model.encode_prompts(prompts)
    sync()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / GIB if cuda_in_use() else None
    return {"prompts": count, "max_sequence_length": cfg.model.max_sequence_length, "encode_s": seconds,
            "weights_gib": weights, "allocated_before_gib": before, "peak_allocated_gib": peak,
            "peak_above_before_gib": None if peak is None else peak - before}  # fmt: skip


def encoders_part(ctx: Context) -> dict:
    """Each model's encoders held, then offloaded, each variant in this part's process one after the other (the
    first's memory released before the second builds); `estimate`'s figures for the ready config beside them."""
    result, entry = {}, ctx.device_entry()
    for name in MODELS:
        run = RUNS[name]
        ready = ready_config(run)
        count = math.ceil(ready.data.prompts_per_step / GPUS)  # one GPU's share of a step's prompts
        target = run_config(ctx, run, []) if ctx.dry_run else ready  # the tiny sizes in the dry run
        predicted = estimate(target, architecture(ctx, run), entry, GPUS, prompt_tokens=PROMPT_TOKENS)
        runs = result[name] = {"estimate": {"text_encoders_gib": predicted.memory_gib["text_encoders"],
                                            "encode_prompts_s": predicted.phase_seconds["encode_prompts"]}}  # fmt: skip
        for label, offload in (("held", False), ("offloaded", True)):
            runs[label] = encoders_variant(ctx, name, offload, count)
            release()
            ctx.keep(result)
    return result
