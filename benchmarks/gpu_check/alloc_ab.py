"""The `alloc_ab` part: the same Flow-GRPO step with CUDA's allocator holding fixed blocks and with expandable segments.

Runs 6 and 7 of the check measured a large gap between what a step's tensors needed and what the caching allocator
held: SD3.5-medium's LoRA step reserved 22.6 GiB for a peak of 13.4 GiB allocated, FLUX.2-klein's 26.3 for 16.3
(other models: 1–5 GiB). Reserved memory is what runs a card out of memory, and what `estimate` is fitted to. Since
this part was written the CLI sets `expandable_segments:True` by default (`engine.cuda_expandable_segments`,
diffusion_rl/utils/cuda_alloc.py), and so does the check; this part measures both settings on those two models at
their parts' sizes: peak allocated and reserved memory and the step's seconds, so the default rests on a measurement.

Each variant runs in its own forked process (`run_variant`, as in cudnn_ab.py): the allocator's setting is set before
the variant's first CUDA call, in its environment and through torch's own setter, and read back into the record.
On a CPU (the dry run) the setting changes nothing, and the record says so.
"""

from __future__ import annotations

import functools
import os
import time

import torch

from .cudnn_ab import run_variant
from .parts import Context, build, memory_gib, reset_peaks, step_health, timed_steps

MODELS = ("sd35_lora", "flux2_klein_lora")  # the two largest gaps of runs 6 and 7, at their parts' sizes
DRY_MODELS, DRY_ROWS = ("sd35_lora",), 2  # the dry run's: one model is enough to keep the part from rotting
VARIANTS = {"fixed_blocks": "expandable_segments:False", "expandable": "expandable_segments:True"}
VARIANT_CAP_S = 80.0  # one variant's process at most (SD3.5's part took 54 s in run 6, its build included)


def variant(ctx: Context, name: str, setting: str) -> dict:
    """In the variant's process: the allocator set, model `name` built, a warm-up step, then one measured step."""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = setting
    torch._C._accelerator_setAllocatorSettings(setting)  # in case this process's config was read before the fork
    started = time.perf_counter()
    _, _, trainer = build(ctx, name, rows=DRY_ROWS if ctx.dry_run else None)
    built_s = time.perf_counter() - started
    warm = timed_steps(trainer, 1)[0]
    warm_memory = memory_gib()  # the build's and the first step's peaks
    reset_peaks()
    measured = timed_steps(trainer, 1, first=1)[0]
    return {**allocator_reading(), "build_s": built_s, "warmup_step_s": warm["wall_s"], "step_s": measured["wall_s"],
            "rollout_s": measured.get("timing/generate"), "update_s": measured.get("timing/update"),
            "warmup_memory": warm_memory, **step_health(measured), **memory_gib()}  # fmt: skip


def allocator_reading() -> dict:
    """What this process's allocator reads back: torch's settings string where torch has the getter (2.11 has not:
    run 9 lost both variants' numbers to that) and, on CUDA, the segments it holds (expandable segments keep a few
    that grow; fixed blocks, one per block the driver gave)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    reading = {"allocator_settings": getter() if getter else f"no getter in torch {torch.__version__}"}
    if torch.cuda.is_initialized():
        reading["segments"] = torch.cuda.memory_stats().get("segment.all.current")
    return reading


def alloc_ab_part(ctx: Context) -> dict:
    """SD3.5-medium's and FLUX.2-klein's LoRA steps with the allocator's fixed blocks, then expandable segments, each
    in its own process: peak allocated and reserved GiB, step seconds, and the ratios expandable / fixed."""
    result = {"variants": {label: f"PYTORCH_CUDA_ALLOC_CONF={setting}" for label, setting in VARIANTS.items()},
              "effect": "none on the CPU: the CUDA allocator is not used" if ctx.dry_run else "cuda",
              "runs": {}}  # fmt: skip
    for name in DRY_MODELS if ctx.dry_run else MODELS:
        runs = result["runs"][name] = {}
        for label, setting in VARIANTS.items():
            runs[label] = run_variant(ctx, f"alloc_ab_{name}_{label}", functools.partial(variant, ctx, name, setting),
                                      VARIANT_CAP_S)  # fmt: skip
            fixed, expandable = (runs.get(v, {}).get("result") or {} for v in VARIANTS)
            for key in ("peak_reserved_gib", "peak_allocated_gib", "step_s"):
                if fixed.get(key) and expandable.get(key):
                    runs[f"{key}_ratio"] = expandable[key] / fixed[key]
            ctx.keep(result)
    return result
