"""The run, train and val sections: run identity and resume, optimisation, checkpoints, validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from diffusion_rl.config.data import RewardSpec
from diffusion_rl.settings import check, opt

if TYPE_CHECKING:
    from diffusion_rl.config import Config
    from diffusion_rl.config.sampling import SamplingConfig


@dataclass
class RunConfig:
    dir: str = opt("runs/quickstart", "Run directory: checkpoints, metrics.jsonl, samples, TensorBoard logs.")
    seed: int = opt(0, "Seed of every random draw (noise, data order, windows, timestep picks).")
    resume: str = opt("auto", "auto (latest checkpoint in run.dir if any), never, or a checkpoint directory.")
    name: str | None = opt(None, "Run name for trackers (default: the run directory's name).")
    val_only: bool = opt(
        False,
        "Validate the resumed checkpoint (or the initial model) and exit without training: the grid and a JSON "
        "of the numbers go to <run.dir>/samples/step_XXXXXX.{png,json}.",
    )


@dataclass
class EmaConfig:
    enabled: bool = opt(False, "Keep an EMA of the trained weights and validate with it.")
    decay: float = opt(0.9, "EMA decay per update.")
    update_every: int = opt(1, "Update the EMA every N optimizer steps.")


@dataclass
class TrainConfig:
    total_steps: int = opt(60, "Training steps (one rollout + update each).")
    lr: float = opt(1e-3, "AdamW learning rate.")
    betas: tuple[float, float] = opt((0.9, 0.999), "AdamW betas.")
    weight_decay: float = opt(1e-4, "AdamW weight decay.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.")
    grad_clip: float = opt(1.0, "Clip the gradient norm to this (0 = off).")
    warmup_steps: int = opt(0, "Linear learning-rate warm-up, in optimizer steps.")
    micro_batch_size: int = opt(8, "Samples per forward/backward (gradient accumulation does the rest).")
    num_minibatches: int = opt(1, "Optimizer steps per epoch over the rollout batch.")
    ppo_epochs: int = opt(1, "Passes over the rollout batch per training step.")
    ema: EmaConfig = opt(EmaConfig, "EMA of the trained weights.", factory=True)
    save_every: int = opt(20, "Checkpoint every N steps (and at the end); 0 = only at the end.")
    keep_last: int = opt(2, "Checkpoints to keep (0 = all).")
    max_consecutive_skips: int = opt(3, "Stop after this many consecutive non-finite updates.")

    def __post_init__(self):
        check(self.total_steps >= 0, "train.total_steps must be ≥ 0")
        check(self.lr > 0, "train.lr must be > 0")
        check(self.save_every >= 0, f"train.save_every must be ≥ 0 (0 = only at the end), got {self.save_every}")
        check(
            self.micro_batch_size >= 1 and self.num_minibatches >= 1 and self.ppo_epochs >= 1,
            "train.micro_batch_size, train.num_minibatches and train.ppo_epochs must be ≥ 1",
        )


@dataclass
class ValConfig:
    every: int = opt(
        10, "Validate every N steps and after the last one (0 = never; val.before_train still validates step 0)."
    )
    before_train: bool = opt(True, "Validate once before the first step.")
    prompts: str | None = opt("configs/prompts/val.txt", "Validation prompts file (null = no validation).")
    n: int = opt(2, "Samples per validation prompt.")
    num_steps: int = opt(20, "ODE steps for validation samples.")
    height: int | None = opt(
        None, "Height of validation samples in pixels (null = sampling.height): train small, validate at full size."
    )
    width: int | None = opt(None, "Width of validation samples in pixels (null = sampling.width).")
    ode_solver: Literal["euler", "dpm2", "ab2"] | None = opt(
        None, "ODE solver of validation samples (null = sampling.ode_solver)."
    )
    guidance: float | None = opt(None, "CFG for validation (null = sampling.guidance).")
    seed: int = opt(1234, "Seed of the validation noise (fixed across the run).")
    rewards: list[RewardSpec] | None = opt(
        None, "Rewards that score validation, e.g. a held-out scorer the run does not optimise (null = `rewards`)."
    )

    def __post_init__(self):
        for key in ("height", "width"):
            value = getattr(self, key)
            check(value is None or value >= 1, f"val.{key} must be ≥ 1 pixel (null = sampling.{key}), got {value}")

    def size(self, sampling: SamplingConfig) -> tuple[int, int]:
        """(height, width) of validation samples: val's own, else the rollouts'."""
        return (self.height or sampling.height, self.width or sampling.width)


def check_val(cfg: Config) -> None:
    check(
        not cfg.run.val_only or bool(cfg.val.prompts),
        "run.val_only=true validates and exits, but val.prompts is null: set val.prompts to a prompt file",
    )
