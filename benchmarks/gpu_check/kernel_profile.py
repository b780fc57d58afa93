"""The `kernel_profile` part: where a step's GPU time goes, from a torch.profiler trace of one Flow-GRPO step.

Wan 2.1 1.3B LoRA runs at 9–12 % MFU against SD3.5-Medium's 18–19 % (runs 2–7), and nothing said why. For each run
(Wan 2.1 first, then SD3.5-Medium LoRA, at their model parts' sizes) step 0 warms up and step 1 runs under the
profiler, the trainer naming its phases (`phase/<name>` ranges, trainer/timing.py). From the trace:

- per phase (`generate`: the rollout and the decode; `update`): its wall seconds, the seconds the GPU was running
  something (the union of its kernels' and copies' intervals inside the phase) and the idle rest. The idle share of
  the rollout bounds what CUDA graphs could save there: they remove launch gaps, not kernel time;
- the kernels by name, the top ones by total time with their share, and the shares of kernel classes (matmul,
  attention, convolution, normalisation, copies and casts, elementwise, reductions) — a layout or cast problem
  shows as copies, a VAE problem as convolutions.

The dry run profiles the same steps at toy sizes on the CPU, which has no device timeline: it reports the phases'
seconds and no kernels (it checks that the part runs).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from .parts import Context, build, release, timed_steps

RUNS_PROFILED = ("wan21_lora", "sd35_lora")
PHASES = ("generate", "update")
TOP_KERNELS = 15
NAME_CHARS = 120  # kernel names are long C++ templates: their start is enough to tell them apart
CLASSES = (  # (class, pattern on the lower-cased kernel name), the first that matches
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("convolution", r"conv|implicit|winograd|im2col"),  # before matmul: cuDNN's convolutions are implicit GEMMs
    ("matmul", r"gemm|cutlass|xmma|cublas|nvjet|matmul|sm\d+_"),
    ("normalisation", r"norm"),
    ("copies and casts", r"memcpy|memset|copy|convert|cast|cat_|transpose|permute|contiguous"),
    ("reduction", r"reduce|sum_|mean|max_|min_|argmax"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton_poi"),
)


@dataclass(frozen=True)
class Span:
    """One interval of a trace, in nanoseconds: a host range (`on_device` False) or a device kernel or copy."""

    name: str
    on_device: bool
    start: int
    end: int


def kernel_class(name: str) -> str:
    lowered = name.lower()
    return next((label for label, pattern in CLASSES if re.search(pattern, lowered)), "other")


def covered_ns(spans: list[Span], lo: int, hi: int) -> int:
    """Nanoseconds of [lo, hi) covered by at least one of `spans` (overlaps counted once)."""
    total, reach = 0, lo
    for span in sorted(spans, key=lambda s: s.start):
        start, end = max(span.start, reach), min(span.end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def summarize(spans: list[Span], phases: tuple[str, ...] = PHASES, top: int = TOP_KERNELS) -> dict:
    """Each phase's wall, busy and idle seconds (the device's spans inside its host range); the device's spans by
    name (top `top` by total time) and by class, with their shares of all device time."""
    device = [s for s in spans if s.on_device]
    out: dict = {"phases": {}}
    for phase in phases:
        ranges = [s for s in spans if not s.on_device and s.name == f"phase/{phase}"]
        wall = sum(r.end - r.start for r in ranges)
        busy = sum(covered_ns(device, r.start, r.end) for r in ranges)
        out["phases"][phase] = {"wall_s": wall / 1e9, "busy_s": busy / 1e9, "idle_s": (wall - busy) / 1e9,
                                "busy_fraction": busy / wall if wall else None}  # fmt: skip
    by_name: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name → [count, ns]
    for span in device:
        entry = by_name[span.name[:NAME_CHARS]]
        entry[0] += 1
        entry[1] += span.end - span.start
    total = sum(ns for _, ns in by_name.values())
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])
    out["device_s"] = total / 1e9
    out["top_kernels"] = [{"name": name, "class": kernel_class(name), "count": count, "s": ns / 1e9,
                           "share": ns / total} for name, (count, ns) in ranked[:top]]  # fmt: skip
    classes: dict[str, int] = defaultdict(int)
    for name, (_, ns) in by_name.items():
        classes[kernel_class(name)] += ns
    out["class_shares"] = {label: ns / total for label, ns in sorted(classes.items(), key=lambda c: -c[1])}
    return out


DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")  # what occupies the device; not the device-side copy
# of a host range (gpu_user_annotation), which would count a phase's whole span as busy


def trace_spans(prof) -> list[Span]:
    """The spans of a finished `torch.profiler.profile` (kineto's events, host and device on one clock): the host's
    named ranges and the device's kernels and copies."""
    spans = []
    for event in prof.profiler.kineto_results.events():
        kind = event.activity_type()
        if kind in DEVICE_ACTIVITIES or kind == "user_annotation":
            end = event.start_ns() + event.duration_ns()
            spans.append(Span(event.name(), kind in DEVICE_ACTIVITIES, event.start_ns(), end))
    return spans


def profiled_step(trainer, cuda: bool) -> tuple[dict, list[Span]]:
    """Step 1 of `trainer` (after step 0 warmed up) under torch.profiler: its metrics and the trace's spans."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    timed_steps(trainer, 1)
    with torch.profiler.profile(activities=activities) as prof:
        (metrics,) = timed_steps(trainer, 1, first=1)
    return metrics, trace_spans(prof)


def kernel_profile_part(ctx: Context) -> dict:
    """Wan 2.1 LoRA's and SD3.5-Medium LoRA's step 1, profiled: phases' busy and idle seconds, top kernels, classes."""
    result = {}
    for name in RUNS_PROFILED:
        cfg, _, trainer = build(ctx, name)
        metrics, spans = profiled_step(trainer, ctx.device_type == "cuda")
        result[name] = {
            "images_per_step": cfg.data.prompts_per_step * cfg.data.group_size, "step_s": metrics["wall_s"],
            "rollout_s": metrics.get("timing/generate"), "update_s": metrics.get("timing/update"),
            **summarize(spans),
        }  # fmt: skip
        del trainer
        release()
        ctx.keep(result)
    return result
