"""The `checkpoint_ab` part: selective gradient checkpointing, every block against the count `auto` picks and half.

`model.gradient_checkpointing` takes `true` (every block, diffusers' own), `false`, N (the first N blocks of each
call) or `auto`: the fewest blocks whose peak by `estimate`'s memory model leaves 5 % of the device's free memory
(diffusion_rl/models/checkpointing.py). The ready configs say `true`; this part measures what `auto` changes, on the
model parts' LoRA steps of SD3.5-Medium (24 blocks) and FLUX.2-klein-4B (double then single blocks) at their ready
configs' micro-batch (8 and 9 images, one optimizer step: the activations checkpointing trades are a micro-batch's):

- `true`: every block (the ready configs);
- `auto`: the count `auto` picks on this device, resolved here as the worker resolves it — the plan a run makes
  (trainer/setup.py, `memory_plan`) weighed by `CheckpointPlan.choose` against the device's free memory, read in the
  variant's process before its model is built — since the check hands the trainer a model it built itself;
- `half`: the first half of the blocks, a point between, to check the memory model's line (N block inputs plus
  max(L − N, 1) blocks' activations).

Each variant in its own process (`run_variant`): a build, a warm-up step, one measured step; step, rollout and update
seconds, peak allocated and reserved GiB, the blocks the model checkpoints (read back from it), `logp_diff_max`,
`estimate`'s peak at that count, and the ratios to `true`. On a CPU (the dry run) `auto` would checkpoint nothing:
the tiny model's `auto` is given a pretend device whose free memory fits exactly half the blocks checkpointed
(`pretend_free`), so the path from the plan to the marked blocks runs.
"""

from __future__ import annotations

import functools
import time

import torch

from diffusion_rl.models.checkpointing import (
    MARGIN,
    CheckpointPlan,
    blocks_per_call,
    describe,
    marked_blocks,
)
from diffusion_rl.trainer.setup import memory_plan

from .cudnn_ab import run_variant
from .parts import (
    GIB,
    RUNS,
    Context,
    architecture,
    build,
    estimated,
    memory_gib,
    reset_peaks,
    run_config,
    step_health,
    timed_steps,
)

MODELS = {"sd35_lora": ("true", "auto", "half"), "flux2_klein_lora": ("true", "auto", "half")}  # in the order run
DRY_MODELS = {"sd35_lora": ("true", "auto")}  # the dry run's: one model (`half` runs `auto`'s path, a count)
COMMON = ("log.flops=false", "train.num_minibatches=1")  # one micro-batch, one optimizer step
VARIANT_CAP_S = 50.0  # SD3.5's 8 images: ~2 s build, ~15 s warm-up, ~11 s step (alloc_ab's 16 images: 53 s)
RATIOS = ("step_s", "rollout_s", "update_s", "peak_allocated_gib", "peak_reserved_gib")


def pretend_free(plan: CheckpointPlan, count: int) -> float:
    """Free bytes of a device on which `plan.choose` picks `count` (≥ 1): the room halfway between the peaks with
    `count` and `count - 1` blocks checkpointed, over the share `auto` uses."""
    between = (plan.activations(count) + plan.activations(count - 1)) / 2
    return (plan.fixed + between) / (1 - MARGIN)


def one_micro_batch(ctx: Context, name: str, extra: list[str]):
    """The run's config with `extra`, one prompt of the ready config's micro-batch of images."""
    micro = run_config(ctx, RUNS[name], extra).train.micro_batch_size
    return run_config(ctx, RUNS[name], extra, rows=micro)


def checkpointed(model) -> tuple[int, int]:
    """(blocks checkpointed, blocks) per call of the model's trained network (one network: neither model has timestep
    experts), read from it: the marked blocks, or every one where diffusers' own checkpointing (`true`) is on."""
    network = model.trained_network(model.pipeline)
    blocks = blocks_per_call(network)
    return (marked_blocks(network) or (blocks if getattr(network, "gradient_checkpointing", False) else 0)), blocks


def variant(ctx: Context, name: str, label: str) -> dict:
    """In the variant's process: `auto` resolved (and `half` counted) from the run's plan, the model built with that
    setting, a warm-up step, then one measured step."""
    run, arch = RUNS[name], architecture(ctx, RUNS[name])
    planned = one_micro_batch(ctx, name, [*COMMON, "model.gradient_checkpointing=auto"])
    plan, auto = memory_plan(planned, arch), {}
    setting = True
    if label == "half":
        setting = plan.blocks // 2
    elif label == "auto":  # before the build, as the worker reads its device's free memory before it loads
        pretend = ctx.device_type != "cuda"
        free = pretend_free(plan, max(plan.blocks // 2, 1)) if pretend else float(torch.cuda.mem_get_info()[0])
        setting = plan.choose(free)
        auto = {"free_gib": free / GIB, "free_pretended": pretend, "plan_fixed_gib": plan.fixed / GIB,
                "plan_per_block_gib": plan.per_block / GIB, "plan_block_input_gib": plan.block_input / GIB,
                "says": describe(plan, free, setting)}  # fmt: skip
    reset_peaks()
    started = time.perf_counter()
    cfg, _, trainer = build(ctx, name, [*COMMON, f"model.gradient_checkpointing={str(setting).lower()}"],
                            rows=planned.data.group_size)  # fmt: skip
    built_s = time.perf_counter() - started
    done, blocks = checkpointed(trainer.engine.model)
    warm = timed_steps(trainer, 1)[0]
    reset_peaks()
    measured = timed_steps(trainer, 1, first=1)[0]
    _, est_peak, est_step = estimated(ctx, run, cfg, arch)
    return {"images": cfg.data.group_size, "setting": setting, "checkpointed_blocks": done, "blocks": blocks,
            "planned_blocks": plan.blocks, **auto, "build_s": built_s, "warmup_step_s": warm["wall_s"],
            "step_s": measured["wall_s"], "rollout_s": measured.get("timing/generate"),
            "update_s": measured.get("timing/update"), "logp_diff_max": measured.get("train/logp_diff_max"),
            "estimate_peak_gib": est_peak, "estimate_step_s": est_step, **step_health(measured),
            **memory_gib()}  # fmt: skip


def ratios(runs: dict) -> dict:
    """Each variant's seconds and peak memory over `true`'s."""
    base = (runs.get("true") or {}).get("result") or {}
    out = {}
    for label, run in runs.items():
        result = (run or {}).get("result") or {}
        if label != "true" and base and result:
            out[label] = {f"{k}_ratio": result[k] / base[k] for k in RATIOS if result.get(k) and base.get(k)}
    return out


def checkpoint_ab_part(ctx: Context) -> dict:
    """SD3.5-Medium and FLUX.2-klein LoRA at their micro-batch with every block checkpointed, `auto`'s count and
    half the blocks, each variant in its own process."""
    models = DRY_MODELS if ctx.dry_run else MODELS
    result = {"variants": {"true": "model.gradient_checkpointing=true (every block: the ready configs)",
                           "auto": "model.gradient_checkpointing=auto, resolved from the run's plan on this device"
                                   + (" (a pretend device: the CPU's auto checkpoints nothing)" if ctx.dry_run else ""),
                           "half": "model.gradient_checkpointing=N, half the blocks"},
              "runs": {}, "ratios": {}}  # fmt: skip
    for name, labels in models.items():
        runs = result["runs"][name] = {}
        for label in labels:
            measure = functools.partial(variant, ctx, name, label)
            runs[label] = run_variant(ctx, f"checkpoint_ab_{name}_{label}", measure, VARIANT_CAP_S)
            result["ratios"][name] = ratios(runs)
            ctx.keep(result)
    return result
