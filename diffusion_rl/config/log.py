"""The log and profile sections: metrics, trackers, rollout dumps, FLOP counting, torch.profiler traces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diffusion_rl.config.fields import MAX_COUNT, Range, check, opt


@dataclass
class WandbConfig:
    enabled: bool = opt(False, "Log to Weights & Biases (pip install 'diffusion-rl[wandb]').")
    project: str = opt("diffusion-rl", "W&B project.")
    mode: Literal["online", "offline"] = opt("offline", "online needs a login; offline writes under run.dir.")
    tags: list[str] = opt(list, "W&B tags.", factory=True)


@dataclass
class LogConfig:
    jsonl: bool = opt(True, "Write <run.dir>/metrics.jsonl.")
    tensorboard: bool = opt(True, "Write TensorBoard events to <run.dir>/tensorboard.")
    wandb: WandbConfig = opt(WandbConfig, "Weights & Biases.", factory=True)
    console_every: int = opt(10, "Console summary line every N steps (0 = never).", within=Range(0, MAX_COUNT))
    progress_bar: bool = opt(True, "Show a progress bar over training steps (only on a terminal).")
    rollout_every: int = opt(
        0,
        "Every N steps write the training rollout (images, prompts, rewards, advantages) to <run.dir>/rollouts/.",
        within=Range(0, MAX_COUNT),
    )
    rollout_max_images: int = opt(
        16, "Images kept per rollout dump (the first ones: whole groups); JSONL has all.", within=Range(0, 100_000)
    )
    flops: bool = opt(
        True,
        "Count each step's FLOPs exactly (torch's flop formulas in a dispatch mode, on the first rollout and update "
        "of each shape, cached) and "
        "log perf/flops_per_step, perf/images_per_s, perf/images_per_device_s and perf/mfu.",
    )
    weight_change: Literal["auto", "on", "off"] = opt(
        "auto",
        "Log train/weight_change_rel, |Δθ| / |θ| of each optimizer step over the trained parameters (mean over the "
        "update's steps): it costs a transient copy of them, so auto logs it up to 50M trained parameters (LoRA of "
        "every family, full fine-tuning of the tiny models), on and off always.",
    )
    peak_tflops: float | None = opt(
        None,
        "Peak dense bf16 TFLOP/s of one device for perf/mfu; null = the device table (H100/H200/H800/A100/L40S/A10/"
        "RTX 4090; docs/estimate.md). A CPU has no entry: set it to log MFU there.",
        within=Range(0, 1e6, lo_open=True),
    )


@dataclass
class ProfileConfig:
    steps: list[int] = opt(
        list,
        "Training steps to trace with torch.profiler (numbered as in metrics.jsonl, from 1).",
        factory=True,
        within=Range(1, MAX_COUNT),
    )
    memory: bool = opt(False, "Also record a CUDA memory snapshot over the profiled steps (GPU only).")

    def __post_init__(self):
        check(len(set(self.steps)) == len(self.steps), f"profile.steps lists a step more than once: {self.steps}")
