"""`diffusion-rl estimate`: memory per GPU and time per step of a config, before launch, from its architecture.

FLOPs are counted exactly on the real module graph built on the meta device (estimate/counting.py): one transformer
call at the training micro-batch (forward, and forward + backward, LoRA adapters included), the VAE decode of one
sample; text encoders analytically per token (estimate/architectures.py). The same calls count the bytes the
memory-bound ops move (elementwise ops, norms, casts, LoRA's thin matmuls; attention as a fused kernel moves it).
Time is a roofline per phase with two terms,

    t(phase) = (max(FLOPs / peak, weight bytes / bandwidth) + memory-bound bytes / bandwidth) / efficiency

summed over the phases of a colocated step (encode prompts → rollout → decode → update → optimizer step), every GPU
doing 1/N of the rows. `efficiency` is the fraction of the datasheet's peak and bandwidth a real step reaches,
fitted on the GPU check's five measured steps on an H200 (EFFICIENCY below); what the roofline leaves out of a real
run (rewards, FSDP collectives, CPU offload, idle time between phases) is not in it.

Memory per GPU adds what a worker holds at its peak, the update: the transformer's weights (the whole of them while
FSDP2 has them gathered, engine.reshard_after_forward false; one shard plus two gathered blocks otherwise), the
trainable parameters' fp32 master/gradient/AdamW state as models/doctor.py counts it (sharded over the workers), a
frozen reference copy (full fine-tuning with a KL), the text encoders, VAE and an image encoder (replicated), the kept
trajectories of the worker's rows, the EMA's fp32 copy of the trained parameters, the VAE decode's working set for a
generate call's rows (counted on meta), and the activations autograd saves for one micro-batch — counted on the meta
device, or, with the first N of L blocks checkpointed (model.gradient_checkpointing: all, none, N, or auto's count:
models/checkpointing.py), N blocks' inputs plus max(L − N, 1) blocks' activations. Plus CONTEXT_GIB for the CUDA
context, allocator fragmentation and kernel workspaces. The memory savers (docs/models.md) take their part off:
`sampling.latents_dtype` the trajectories' window, `model.offload_frozen` the text encoders, VAE and image encoder,
`model.offload_reference` the reference copy, `engine.fsdp_cpu_offload` the shards and the optimizer state.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from diffusion_rl.config.fields import Range
from diffusion_rl.data.prompts import condition_images_in
from diffusion_rl.errors import UserError
from diffusion_rl.estimate.architectures import (
    CLIP_TOKENS,
    QWEN_TEMPLATE_TOKENS,
    Architecture,
    guidance_cost_of,
    image_sizes_of,
)
from diffusion_rl.estimate.counting import Shapes, build_on_meta, transformer_cost, vae_decode_cost, vae_encode_cost
from diffusion_rl.estimate.devices import Device
from diffusion_rl.models.checkpointing import CheckpointPlan, checked_count
from diffusion_rl.models.condition import VAE_ROWS
from diffusion_rl.models.guidance import Guidance, refuse_low_noise_without_experts
from diffusion_rl.models.image_size import size_problem
from diffusion_rl.models.registry import family_named
from diffusion_rl.sampling.tree import TreeSpec
from diffusion_rl.utils.dtypes import DTYPES

# Fitted on the GPU check of 2026-11-26 on one NVIDIA H200 (benchmarks/results/gpu_check_h200.json, `merged`): the
# geometric mean, over its five model parts (SD3.5-Medium LoRA and full, FLUX.1-dev LoRA, Qwen-Image LoRA, Wan 2.1
# 1.3B LoRA), of the roofline's ideal rollout + update seconds over the measured ones (0.5218); each part is then
# within −10.4 % … +15.2 % (tests/test_estimate_calibration.py). Other GPUs scale by their datasheet peak and bandwidth.
EFFICIENCY = 0.522
EFFICIENCY_RANGE = Range(0, 1, lo_open=True)  # `estimate --efficiency`: a fraction of the datasheet's numbers
CONTEXT_GIB = 2.0  # CUDA context, fragmentation, workspaces (models/doctor.py: "typically 1–3 GB")
GIB = 2**30
TIGHT = 0.05  # a fit with less free device memory than this share of it is reported with a warning
HOST_RAM_GIB = 1024.0  # `estimate --node-ram-gib`'s default: 8-GPU nodes carry 1-2 TB (a DGX H100 2 TB)
GPUS_PER_NODE = 8  # `estimate --gpus-per-node`'s default: Ray places one worker per GPU
CONDITION_SIZE = (384, 384)  # the size Qwen-Image-Edit's pipelines give the VL encoder's condition image (~384²)


@dataclass
class Estimate:
    config: str
    architecture: str
    gpu: str
    gpus: int
    samples: str  # what a sample is, for the reader: "images", or "videos" for a video family
    images_per_step: int
    # FLOPs of one step, all GPUs together
    flops_rollout: float
    flops_update: float
    flops_per_step: float
    # memory per GPU, GiB
    memory_gib: dict[str, float]
    peak_memory_gib_per_gpu: float  # as the config runs (with its model.gradient_checkpointing)
    checkpointed_blocks: int  # of `blocks` (per transformer call), as model.gradient_checkpointing chooses here
    blocks: int
    checkpoint_plan: CheckpointPlan  # what model.gradient_checkpointing=auto weighs (bytes)
    peak_memory_gib_per_gpu_unchecked: float  # the same without gradient checkpointing
    peak_memory_gib_per_gpu_checkpointed: float  # ... and with it
    gpu_memory_gib: float | None
    headroom_gib: float | None  # the device's memory left free at the peak (negative: does not fit)
    fits: bool | None  # the config as it is fits the device (None: no capacity known)
    fits_without_checkpointing: bool | None
    fits_with_checkpointing: bool | None
    # time
    phase_seconds: dict[str, float]
    step_seconds: float
    images_per_second: float
    images_per_gpu_second: float
    total_steps: int
    gpu_hours: float
    efficiency: float
    # host memory (what the memory savers keep on the CPU), GiB: by part for one worker, and a node's workers
    host_memory_gib: dict[str, float]
    host_memory_gib_per_worker: float
    workers_per_node: int
    host_memory_gib_per_node: float
    node_ram_gib: float
    host_fits: bool
    assumptions: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


def lora_params(module: torch.nn.Module, targets: tuple[str, ...], rank: int) -> int:
    """Parameters of rank-`rank` LoRA adapters on the Linear layers whose names end with a target (peft's rule)."""
    total = 0
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            total += rank * (m.in_features + m.out_features)
    return total


def estimate(cfg, arch: Architecture, device: Device, gpus: int, *, config_name: str = "", prompt_tokens: int = 64,
             efficiency: float = EFFICIENCY, gpus_per_node: int = GPUS_PER_NODE,
             node_ram_gib: float = HOST_RAM_GIB) -> Estimate:  # fmt: skip
    """Estimate one training step of `cfg` on `gpus` devices of `device` (see the module docstring). What the loss
    and the model family imply comes from their registrations: the loss's algorithm (trained and frozen calls, CFG,
    reference) and the family's adapter (transformer inputs, text tokens, condition images)."""
    s, t, m, e = cfg.sampling, cfg.train, cfg.model, cfg.engine
    problem = size_problem(image_sizes_of(arch), s.height, s.width, ("sampling.height", "sampling.width"))
    if problem:  # the model's own check, before a meta forward would fail on it
        raise UserError(f"sampling.height/width do not fit {arch.name}: {problem}")
    algorithm, settings = cfg.algorithm.spec.algorithm, cfg.algorithm.settings
    family = family_named(arch.family)
    images = cfg.data.prompts_per_step * cfg.data.group_size
    rows = math.ceil(images / gpus)  # rows per GPU
    sharded = e.kind == "ray" and gpus > 1
    full = not m.lora.enabled
    # FLUX.1-dev: guidance is an embedding, one forward; FLUX.2-klein ignores it; the others run true CFG over a
    # doubled batch (Wan 2.2 A14B: when either expert's scale is > 1)
    refuse_low_noise_without_experts(s.guidance_low_noise, "sampling.guidance_low_noise", arch.family, arch.experts)
    guidance_cost = guidance_cost_of(arch)
    cfg_factor = guidance_cost.forwards(Guidance(s.guidance, s.guidance_low_noise))
    train_cfg = cfg_factor if algorithm.guided else 1  # direct preference trains the conditional velocity
    text = family.adapter.text_tokens(arch, m.max_sequence_length, prompt_tokens)
    known = condition_images_in(cfg.data.train) if family.adapter.edits else 0  # an edit's, FLUX.2's references
    sources = 1 if known is None else known  # an edit dataset still to prepare: one per prompt
    vision = [enc for enc in arch.text_encoders if enc.vision]
    if sources and vision:  # Qwen-Image-Edit: the condition images' tokens are part of the prompt's embedding
        text = min(text + sources * vision[0].vision_flops(*CONDITION_SIZE)[1], m.max_sequence_length)
    dtype = DTYPES[m.dtype]
    wbytes = dtype.itemsize

    micro = min(t.micro_batch_size, rows)
    source_size = family.adapter.condition_size(m.condition_size, s.height, s.width)  # the size the model reads
    shapes = Shapes(micro * train_cfg, s.height, s.width, s.num_frames, text, sources, source_size)
    targets = tuple(m.lora.target_modules) or family.lora_targets
    adapters = None if full else (targets, m.lora.rank)
    cost = transformer_cost(arch, shapes, full_finetune=full, dtype=dtype, lora=adapters)
    fwd_per_row = cost.forward_flops / shapes.batch  # one row of one call, guidance not applied
    module = build_on_meta(arch.transformer_class, arch.transformer_config)
    # Wan 2.2 A14B: two experts of this architecture, both trained and held, one run per call
    trainable = (cost.params if full else lora_params(module, targets, m.lora.rank)) * arch.experts
    # the optimizer trains one group per trained policy: LoRA adapters beside the policy's (TDM-R1: 3), alike in size
    optimized = trainable * len(algorithm.optimizer_groups(settings))
    vae = build_on_meta(arch.vae_class, arch.vae_config)
    vae_params = sum(p.numel() for p in vae.parameters())
    decode = vae_decode_cost(arch, s.height, s.width, s.num_frames, dtype)

    # -- FLOPs and bytes per GPU, per phase ---------------------------------------------------------------------
    weights = cost.params * wbytes  # one expert's: what a call streams
    held = arch.experts * weights
    # the rollout's encode_prompts takes each distinct text, and each distinct condition image, once: per GPU its
    # prompts (a group shares its prompt and images) and the negative
    prompts = math.ceil(cfg.data.prompts_per_step / gpus)
    text_flops = 0.0
    for enc in arch.text_encoders:
        padded = m.max_sequence_length  # T5 and FLUX.2's Qwen3 and Mistral-3 read the padded text
        tokens = {"clip": enc.positions or CLIP_TOKENS, "t5": padded, "qwen3": padded, "mistral3": padded}.get(
            enc.kind, QWEN_TEMPLATE_TOKENS + min(prompt_tokens, m.max_sequence_length)
        )
        texts = prompts + 1
        if enc.vision and sources:  # Qwen-Image-Edit: each prompt and its negative with the images, vision tower too
            flops, vision_tokens = enc.vision_flops(*CONDITION_SIZE)
            texts = 2 * prompts
            text_flops += texts * sources * flops
            tokens += sources * vision_tokens
        text_flops += texts * enc.forward_flops(tokens)
    text_bytes = sum(enc.weight_params for enc in arch.text_encoders) * wbytes
    image = arch.image_encoder  # Wan 2.1 I2V: each prompt's frame through CLIP once, in the rollout's encode
    image_bytes = image.weight_params * wbytes if image else 0
    if image is not None:  # FLF2V reads two frames' tokens in one sequence (pos_embed_seq_len 514 = 2 × 257)
        frames = max(1, (arch.transformer_config.get("pos_embed_seq_len") or 0) // image.positions)
        text_flops += prompts * frames * image.forward_flops(image.positions)
    # an editing family's condition images (Wan I2V: its given frames) through the VAE's encoder, once per prompt
    encodes = [vae_encode_cost(arch, h, w, f, dtype) for f, h, w in family.adapter.condition_encodes(
        arch.transformer_config, sources, s.num_frames, source_size)]  # fmt: skip
    text_flops += prompts * sum(c.flops for c in encodes)
    encode_traffic = prompts * sum(c.traffic for c in encodes)
    vae_read = vae_params * wbytes if encodes else 0

    # transformer evaluations per image: T, or a tree's NFE_tree / N (its shared steps are taken once per node)
    tree = TreeSpec.of(s.tree)
    evaluations = s.num_steps if tree is None else tree.evaluations(s.num_steps) / tree.leaves
    rollout_flops = rows * evaluations * cfg_factor * fwd_per_row
    rollout_bytes = s.num_steps * s.score_chunks * weights  # the weights stream once per call
    rollout_traffic = rows * evaluations * cfg_factor * cost.forward_traffic / shapes.batch
    decode_flops = rows * decode.flops

    master = 4 if (not full or e.mixed_precision == "bf16") else wbytes  # LoRA weights stay fp32

    # -- memory per GPU ---------------------------------------------------------------------------------------
    shard = gpus if sharded else 1
    gathered = not (sharded and e.reshard_after_forward)
    # engine.fsdp_cpu_offload: the shards and the optimizer state are in host memory; the device holds what is
    # gathered and the gradients until they are reduced
    host = e.kind == "ray" and e.fsdp_cpu_offload
    resident = 0 if host else held / shard
    transformer_mem = held if gathered else resident + 2 * weights / cost.blocks
    gradients = optimized * master / (1 if gathered else shard) if full else optimized * 4 / shard
    if full:  # moments (and fp32 master weights under mixed precision) sharded; gradients gathered until the step
        optimizer_state = 2 * optimized * master / shard + (optimized * master / shard if master != wbytes else 0)
    else:  # fp32 adapters: weights and two moments (and `gradients`)
        optimizer_state = 3 * optimized * 4 / shard
    train_state = gradients + (0 if host else optimizer_state)  # fsdp_cpu_offload: the state is on the host
    # model.offload_reference: the copy is on the device only for its forward, which runs before the trained one
    kl = algorithm.needs_reference(settings)
    reference = held / shard if (full and kl and not (m.offload_reference or host)) else 0
    latent_numel = shapes_numel(arch, s)
    stochastic = (s.num_steps - 1) if s.window.kind == "all" else s.window.size
    cond_per_row = 2 * text * _text_width(arch) * wbytes  # prompt and negative embeddings
    # the window's latents (W + 1) and means (W) in sampling.latents_dtype, the final latents in fp32
    stored = (2 * stochastic + 1) * DTYPES[s.latents_dtype].itemsize + 4
    trajectory = rows * (stored * latent_numel + cond_per_row)
    frozen = 0 if m.offload_frozen else 1  # model.offload_frozen: on the device only for their calls, not the update
    ema = trainable * 4 / shard if t.ema.enabled else 0  # engine/ema.py: an fp32 copy of the trained parameters
    # the VAE decodes a generate call's rows VAE_ROWS at a time, and encodes its prompts' distinct condition images
    # as many at a time at most; the caching allocator keeps the blocks of the larger working set reserved beside the
    # update's activations (nothing returns them while the device has room)
    per_call = math.ceil(rows / s.score_chunks)
    decoding = min(per_call, VAE_ROWS) * decode.peak_bytes
    encoding = min(min(prompts, per_call) * len(encodes), VAE_ROWS) * max((c.peak_bytes for c in encodes), default=0)
    memory = {
        "transformer": transformer_mem,
        "trainable_state": train_state,
        "ema": ema,
        "reference_copy": reference,
        "text_encoders": frozen * text_bytes,
        "vae": frozen * vae_params * wbytes,
        **({"image_encoder": frozen * image_bytes} if image else {}),
        "trajectories": trajectory,
        "vae_working_set": max(decoding, encoding),
        "activations": 0.0,  # below: with the blocks model.gradient_checkpointing checkpoints
        "context": CONTEXT_GIB * GIB,
    }
    # host memory: what the savers take off the device stays in each worker's process on the CPU (model.offload_frozen:
    # the frozen encoders and VAE, whole in every worker; model.offload_reference: the local engine's reference copy;
    # engine.fsdp_cpu_offload: the worker's shards and optimizer state)
    moved = 1 - frozen
    host_parts = {
        "text_encoders": moved * text_bytes,
        "vae": moved * vae_params * wbytes,
        **({"image_encoder": moved * image_bytes} if image else {}),
        "reference_copy": held / shard if (full and kl and (m.offload_reference or host)) else 0,
        "shards": held / shard if host else 0,
        "optimizer_state": optimizer_state if host else 0,
    }
    host_worker = sum(host_parts.values()) / GIB
    workers_per_node = min(gpus, gpus_per_node) if e.kind == "ray" else 1
    capacity = device.memory_gib
    plan = CheckpointPlan(sum(memory.values()), cost.blocks, cost.saved_bytes, cost.hidden_bytes)
    checkpointed = checkpoint_count(m.gradient_checkpointing, plan, None if capacity is None else capacity * GIB)
    memory["activations"] = plan.activations(checkpointed)
    peak_plain = (plan.fixed + plan.activations(0)) / GIB
    peak_ckpt = (plan.fixed + plan.activations(plan.blocks)) / GIB
    peak = (plan.fixed + memory["activations"]) / GIB

    # -- the update's time, with the checkpointed blocks' forward recomputed ---------------------------------------
    trained_rows = rows * algorithm.trained_share(cfg.algorithm, cfg.data.group_size)  # DPO: a pair per group
    calls = trained_rows * algorithm.trained_calls(cfg.algorithm, cfg.sampling) * t.ppo_epochs  # × trained steps
    micro_batches = math.ceil(calls / micro)
    recomputed = checkpointed / plan.blocks  # the share of a forward the backward runs again
    per_micro = cost.train_flops + recomputed * cost.forward_flops
    # no-grad micro-batches an update runs once before its epochs (the decoupled correction's old policy)
    before = math.ceil(rows * algorithm.calls_before_update(cfg.algorithm, cfg.sampling) / micro)
    # forwards without gradient per trained call
    no_grad = algorithm.frozen_calls(cfg.algorithm, cfg.sampling, guidance_cost)
    update_flops = micro_batches * (per_micro + no_grad * cost.forward_flops)
    update_flops += before * cost.forward_flops
    update_bytes = (2 * micro_batches + before) * weights
    forwards = no_grad + recomputed
    update_traffic = micro_batches * (cost.train_traffic + forwards * cost.forward_traffic)
    update_traffic += before * cost.forward_traffic
    optimizer_steps = t.num_minibatches * t.ppo_epochs
    state = optimized * (master + 3 * master)  # weights, gradient, two AdamW moments
    optimizer_bytes = optimizer_steps * 2 * state / (gpus if sharded else 1)  # read and write once

    def seconds(flops: float, weights_moved: float, traffic: float = 0.0) -> float:
        bandwidth = device.bandwidth_gbs * 1e9
        return (max(flops / (device.peak_tflops * 1e12), weights_moved / bandwidth) + traffic / bandwidth) / efficiency

    phases = {
        "encode_prompts": seconds(text_flops, text_bytes + image_bytes + vae_read, encode_traffic),
        "rollout": seconds(rollout_flops, rollout_bytes, rollout_traffic),
        "decode": seconds(decode_flops, rows * vae_params * wbytes, rows * decode.traffic),
        "update": seconds(update_flops, update_bytes, update_traffic),
        "optimizer": seconds(0.0, 0.0, optimizer_bytes),
    }
    step = sum(phases.values())
    ips = images / step
    return Estimate(
        config=config_name,
        architecture=arch.name,
        gpu=device.key,
        gpus=gpus,
        samples="videos" if family.adapter.video else "images",
        images_per_step=images,
        flops_rollout=(text_flops + rollout_flops + decode_flops) * gpus,
        flops_update=update_flops * gpus,
        flops_per_step=(text_flops + rollout_flops + decode_flops + update_flops) * gpus,
        memory_gib={k: v / GIB for k, v in memory.items()},
        peak_memory_gib_per_gpu=peak,
        checkpointed_blocks=checkpointed,
        blocks=plan.blocks,
        checkpoint_plan=plan,
        peak_memory_gib_per_gpu_unchecked=peak_plain,
        peak_memory_gib_per_gpu_checkpointed=peak_ckpt,
        gpu_memory_gib=capacity,
        headroom_gib=None if capacity is None else capacity - peak,
        fits=None if capacity is None else peak <= capacity,
        fits_without_checkpointing=None if capacity is None else peak_plain <= capacity,
        fits_with_checkpointing=None if capacity is None else peak_ckpt <= capacity,
        phase_seconds=phases,
        step_seconds=step,
        images_per_second=ips,
        images_per_gpu_second=ips / gpus,
        total_steps=t.total_steps,
        gpu_hours=t.total_steps * step * gpus / 3600,
        efficiency=efficiency,
        host_memory_gib={k: v / GIB for k, v in host_parts.items()},
        host_memory_gib_per_worker=host_worker,
        workers_per_node=workers_per_node,
        host_memory_gib_per_node=host_worker * workers_per_node,
        node_ram_gib=node_ram_gib,
        host_fits=host_worker * workers_per_node <= node_ram_gib,
        assumptions=[
            f"text tokens per sample {text} (prompt tokens {prompt_tokens} where the family cuts padding)",
            f"condition images per sample {sources} (data.train's; an edit dataset not there yet: one)"
            + (f", each read at {source_size[0]}×{source_size[1]} (model.condition_size)" if sources else ""),
            f"{'true CFG: doubled batch' if cfg_factor == 2 else 'one forward per step'}; micro-batch {micro}",
            f"{evaluations:.3g} transformer evaluations per image in the rollout"
            + ("" if tree is None else f" (a tree of {tree.leaves} leaves instead of {s.num_steps})"),
            f"trainable parameters {trainable / 1e6:.1f}M of {arch.experts * cost.params / 1e9:.2f}B"
            + ("" if arch.experts == 1 else f" ({arch.experts} experts, one per transformer call)"),
            "rewards, FSDP collectives and the time of offloading's copies are not modelled: the efficiency is "
            "fitted on single-GPU steps without them (docs/estimate.md)",
        ],
    )


def checkpoint_count(setting: bool | int | str, plan: CheckpointPlan, free: float | None) -> int:
    """The blocks per call model.gradient_checkpointing checkpoints: `auto` as chosen for `free` bytes (the device's
    capacity; None: unknown, none), else the setting's (a UserError past the block count)."""
    return plan.choose(free) if setting == "auto" else checked_count(setting, plan.blocks)


def shapes_numel(arch: Architecture, s) -> int:
    """Latent numbers per sample (what a trajectory stores per step)."""
    h, w = s.height // arch.vae_scale, s.width // arch.vae_scale
    c = arch.vae_config.get("latent_channels") or arch.vae_config.get("z_dim")
    f = (s.num_frames - 1) // arch.temporal_scale + 1 if arch.temporal_scale > 1 else 1
    return c * f * h * w


def _text_width(arch: Architecture) -> int:
    c = arch.transformer_config
    return c.get("joint_attention_dim") or c.get("text_dim") or 4096
