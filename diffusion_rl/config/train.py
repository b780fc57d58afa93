"""The run, train and val sections: run identity and resume, optimisation, checkpoints, validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from diffusion_rl.config.data import RewardSpec
from diffusion_rl.config.fields import MAX_BATCH, MAX_COUNT, MAX_GROUP, MAX_PIXELS, MAX_STEPS, OneOf, Range, opt
from diffusion_rl.config.plugins import ODE_SOLVERS

if TYPE_CHECKING:
    from diffusion_rl.config.sampling import SamplingConfig


@dataclass
class RunConfig:
    dir: str = opt(
        "runs/default", "Run directory: checkpoints, metrics.jsonl, samples, TensorBoard logs. A config file that sets "
        "none (nor its base) runs in runs/<the file's name>.",
    )  # fmt: skip
    seed: int = opt(0, "Seed of every random draw (noise, data order, windows, timestep picks).")
    resume: str = opt(
        "auto",
        "auto (latest checkpoint in run.dir if any), never (start over: an earlier run in run.dir is moved aside to "
        "<run.dir>.before-<time>), or a checkpoint directory.",
    )
    name: str | None = opt(None, "Run name for trackers (default: the run directory's name).")
    val_only: bool = opt(
        False,
        "Validate the resumed checkpoint (or the initial model) and exit without training: the grid and a JSON "
        "of the numbers go to <run.dir>/samples/step_XXXXXX.{png,json}.",
    )


@dataclass
class EmaConfig:
    enabled: bool = opt(False, "Keep an EMA of the trained weights and validate with it.")
    decay: float = opt(0.9, "EMA decay per update.", within=Range(0, 1))
    update_every: int = opt(1, "Update the EMA every N optimizer steps.", within=Range(1, MAX_COUNT))
    warmup: bool = opt(
        False, "Warm the decay up as flow_grpo's EMA wrapper does (the recipes built on flow_grpo's scripts and "
        "TDM-R1's keep it): at the n-th optimizer step (1-based) the update's decay is min(n / (n + 9), decay). Theirs "
        "updates one step earlier (after steps n ≡ −1 mod update_every, at the same decays) and once per micro-batch "
        "until the next optimizer step.",
    )  # fmt: skip


@dataclass
class TrainConfig:
    total_steps: int = opt(60, "Training steps (one rollout + update each).", within=Range(0, MAX_COUNT))
    lr: float = opt(1e-3, "AdamW learning rate.", within=Range(0, 1e6, lo_open=True))
    betas: tuple[float, float] = opt((0.9, 0.999), "AdamW betas.", within=Range(0, 1))
    weight_decay: float = opt(1e-4, "AdamW weight decay.", within=Range(0, 10))
    adam_eps: float = opt(1e-8, "AdamW epsilon.", within=Range(0, 1, lo_open=True))
    fused_adamw: bool | Literal["auto"] = opt(
        "auto",
        "torch's fused AdamW kernel (one launch for all parameters). auto: on when the trained parameters are on a "
        "CUDA device, off elsewhere (the CPU keeps torch's default AdamW).",
    )
    grad_clip: float = opt(1.0, "Clip the gradient norm to this (0 = off).", within=Range(0, 1e6))
    warmup_steps: int = opt(0, "Linear learning-rate warm-up, in optimizer steps.", within=Range(0, MAX_COUNT))
    micro_batch_size: int = opt(
        8, "Samples per forward/backward (gradient accumulation does the rest).", within=Range(1, MAX_BATCH)
    )
    num_minibatches: int = opt(1, "Optimizer steps per epoch over the rollout batch.", within=Range(1, MAX_BATCH))
    ppo_epochs: int = opt(1, "Passes over the rollout batch per training step.", within=Range(1, 100))
    ema: EmaConfig = opt(EmaConfig, "EMA of the trained weights.", factory=True)
    save_every: int = opt(
        20, "Checkpoint every N steps (and at the end); 0 = only at the end.", within=Range(0, MAX_COUNT)
    )
    keep_last: int = opt(2, "Checkpoints to keep (0 = all).", within=Range(0, 1_000_000))
    max_consecutive_skips: int = opt(3, "Stop after this many consecutive non-finite updates.", within=Range(0, 1000))


@dataclass
class ValConfig:
    every: int = opt(
        10,
        "Validate every N steps and after the last one (0 = never; val.before_train still validates step 0).",
        within=Range(0, MAX_COUNT),
    )
    before_train: bool = opt(True, "Validate once before the first step.")
    prompts: str | None = opt("configs/prompts/val.txt", "Validation prompts file (null = no validation).")
    n: int = opt(2, "Samples per validation prompt.", within=Range(1, MAX_GROUP))
    num_steps: int = opt(20, "ODE steps for validation samples.", within=Range(1, MAX_STEPS))
    height: int | None = opt(
        None,
        "Height of validation samples in pixels (null = sampling.height): train small, validate at full size.",
        within=Range(1, MAX_PIXELS),
    )
    width: int | None = opt(
        None, "Width of validation samples in pixels (null = sampling.width).", within=Range(1, MAX_PIXELS)
    )
    ode_solver: str | None = opt(
        None, "ODE solver of validation samples (null = sampling.ode_solver).", within=OneOf(ODE_SOLVERS)
    )
    guidance: float | None = opt(None, "CFG for validation (null = sampling.guidance).", within=Range(1, 100))
    guidance_low_noise: float | None = opt(
        None,
        "Wan 2.2 A14B: validation's guidance of the low-noise expert (null = sampling.guidance_low_noise; where that "
        "is null too, validation's guidance).",
        within=Range(1, 100),
    )
    seed: int = opt(1234, "Seed of the validation noise (fixed across the run).")
    rewards: list[RewardSpec] | None = opt(
        None, "Rewards that score validation, e.g. a held-out scorer the run does not optimise (null = `rewards`)."
    )

    def size(self, sampling: SamplingConfig) -> tuple[int, int]:
        """(height, width) of validation samples: val's own, else the rollouts'."""
        return (self.height or sampling.height, self.width or sampling.width)

    def guidance_scales(self, sampling: SamplingConfig) -> tuple[float, float | None]:
        """(guidance, low-noise expert's guidance) of validation samples: val's own, else the rollouts'."""
        low_noise = self.guidance_low_noise if self.guidance_low_noise is not None else sampling.guidance_low_noise
        return (self.guidance if self.guidance is not None else sampling.guidance), low_noise
