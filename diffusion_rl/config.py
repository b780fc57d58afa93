"""The configuration: one typed dataclass tree, loaded from YAML plus dotted `key=value` overrides.

Every field has a default and a one-line help text; `__post_init__` rejects impossible values with a message
that says what to change. `diffusion-rl config show CONFIG` prints the resolved tree and
`docs/config.md` is generated from it (`diffusion-rl config reference`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from diffusion_rl.algorithms.rollout_correction import RolloutCorrectionConfig
from diffusion_rl.config_io import load_config


def opt(default: Any, help: str, *, factory: bool = False):
    """A config field with its help text (`factory` for mutable defaults)."""
    if factory:
        return field(default_factory=default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class RunConfig:
    dir: str = opt("runs/quickstart", "Run directory: checkpoints, metrics.jsonl, samples, TensorBoard logs.")
    seed: int = opt(0, "Seed of every random draw (noise, data order, windows, timestep picks).")
    resume: str = opt("auto", "auto (latest checkpoint in run.dir if any), never, or a checkpoint directory.")
    name: str | None = opt(None, "Run name for trackers (default: the run directory's name).")


@dataclass
class LoraConfig:
    enabled: bool = opt(True, "Train a LoRA adapter (peft) instead of the full transformer.")
    rank: int = opt(32, "LoRA rank r.")
    alpha: int = opt(64, "LoRA alpha (scale = alpha / rank).")
    target_modules: list[str] = opt(list, "Module names to adapt; empty = the family's preset.", factory=True)

    def __post_init__(self):
        _check(self.rank >= 1, f"lora.rank must be ≥ 1, got {self.rank}")


@dataclass
class ModelConfig:
    path: str = opt("models/tiny", "Local diffusers-format model directory.")
    family: Literal["auto", "sd3"] = opt("auto", "Model family; auto reads model_index.json.")
    dtype: Literal["fp32", "bf16", "fp16"] = opt("fp32", "Weight dtype (SDE math is always fp32).")
    device: str = opt("auto", "auto, cpu, cuda or cuda:N.")
    lora: LoraConfig = opt(LoraConfig, "LoRA settings.", factory=True)
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    max_sequence_length: int = opt(256, "Text tokens per prompt (T5).")
    create_tiny_if_missing: Literal["base", "small"] | None = opt(
        None, "Create the tiny model of this preset at model.path when the directory does not exist."
    )


@dataclass
class WindowConfig:
    kind: Literal["all", "random", "sliding"] = opt(
        "all",
        "all: every step but the last is SDE (Flow-GRPO); random: a window of `size` steps at a seeded random "
        "start in [lo, hi − size] (Flow-GRPO-Fast); sliding: MixGRPO's window moving along the trajectory.",
    )
    size: int = opt(2, "Window length in steps (random, sliding).")
    lo: int = opt(0, "random: first step the window may start at.")
    hi: int | None = opt(None, "random: the window ends by this step (exclusive); null = num_steps − 1.")
    iters_per_window: int = opt(25, "sliding: training steps the window stays at one position.")
    stride: int = opt(1, "sliding: how far the window moves each time.")
    strategy: Literal["progressive", "random"] = opt("progressive", "sliding: move along, or a random start each step.")


@dataclass
class SamplingConfig:
    num_steps: int = opt(10, "Denoising steps of a training rollout.")
    guidance: float = opt(4.5, "Classifier-free guidance scale (1 = no CFG: one forward per step).")
    height: int = opt(64, "Image height in pixels.")
    width: int = opt(64, "Image width in pixels.")
    sde_type: Literal["sde", "cps", "dance_sde"] = opt("sde", "Stochastic step inside the window.")
    noise_level: float = opt(0.7, "SDE noise level a (η for dance_sde).")
    window: WindowConfig = opt(WindowConfig, "Which steps are stochastic (and trained).", factory=True)
    share_initial_noise: bool = opt(False, "Same initial noise for every sample of a prompt's group.")

    def __post_init__(self):
        _check(self.num_steps >= 2, f"sampling.num_steps must be ≥ 2, got {self.num_steps}")
        _check(self.noise_level >= 0, f"sampling.noise_level must be ≥ 0, got {self.noise_level}")
        _check(self.guidance >= 1, f"sampling.guidance must be ≥ 1 (1 disables CFG), got {self.guidance}")


@dataclass
class DataConfig:
    train: str = opt("configs/prompts/quickstart.txt", "Training prompts: .txt, .jsonl or .parquet.")
    prompts_per_step: int = opt(2, "Distinct prompts per training step.")
    group_size: int = opt(4, "Samples per prompt (the group for advantages).")
    shuffle: bool = opt(True, "Shuffle prompt order each epoch (seeded).")

    def __post_init__(self):
        _check(self.prompts_per_step >= 1, "data.prompts_per_step must be ≥ 1")
        _check(self.group_size >= 1, "data.group_size must be ≥ 1")


@dataclass
class RewardSpec:
    name: str = opt("jpeg_incompressibility", "Registered reward name, or module:function / file.py:function.")
    weight: float = opt(1.0, "Weight in the weighted sum.")
    required: bool = opt(True, "A failure of this reward fails the sample; false: left out and renormalised.")
    kwargs: dict[str, Any] = opt(dict, "Keyword arguments for the reward.", factory=True)


@dataclass
class AdvantageConfig:
    global_std: bool = opt(True, "Divide by the batch std (true) or each group's own std (false).")
    std_ddof: int = opt(0, "Delta degrees of freedom of the std (0 as flow_grpo, 1 as DanceGRPO).")
    eps: float = opt(1e-4, "Added to the std in the denominator.")
    normalize_by_std: bool = opt(True, "false: A = r − group mean.")
    combine: Literal["sum_rewards", "sum_advantages"] = opt(
        "sum_rewards",
        "sum_rewards: normalise the weighted reward sum; sum_advantages: normalise each reward within its groups, "
        "then sum the advantages with the weights (MixGRPO's advantage_aggr).",
    )


# losses whose formulas assume the Flow-GRPO `sde` step (std_dev_t and √dt of that step)
SDE_ONLY_LOSSES = ("grpo_guard", "flow_dppo")


@dataclass
class AlgorithmConfig:
    family: Literal["policy_gradient"] = opt("policy_gradient", "Algorithm family.")
    loss: str = opt("flow_grpo", "Registered policy loss.")
    clip_range: float = opt(1e-4, "PPO ratio clip range.")
    adv_clip_max: float = opt(5.0, "Advantages are clamped to ±this inside the loss.")
    kl_beta: float = opt(0.0, "Weight of the KL to the reference policy (0 = off, no reference forward).")
    timestep_fraction: float = opt(1.0, "Fraction of the window's steps trained per sample.")
    timestep_selection: Literal["first", "random"] = opt("first", "first (flow_grpo) or a seeded random subset.")
    drop_zero_advantage: bool = opt(False, "Leave samples with advantage 0 out of the loss.")
    kl_mask_threshold: float = opt(1e-5, "flow_dppo: mask a sample moving further when its KL to the rollout ≥ this.")
    add_kl_coefficient: bool = opt(True, "flow_dppo: divide the mean gap by 2(std·√dt)² (false: by 2).")
    advantage: AdvantageConfig = opt(AdvantageConfig, "Group advantage normalisation.", factory=True)
    rollout_correction: RolloutCorrectionConfig = opt(
        RolloutCorrectionConfig, "Importance weights / rejection between rollout and trained policy.", factory=True
    )

    def __post_init__(self):
        _check(
            0 < self.timestep_fraction <= 1,
            f"algorithm.timestep_fraction must be in (0, 1], got {self.timestep_fraction}",
        )
        _check(self.clip_range > 0, "algorithm.clip_range must be > 0")
        _check(self.kl_beta >= 0, "algorithm.kl_beta must be ≥ 0")


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
        _check(self.total_steps >= 0, "train.total_steps must be ≥ 0")
        _check(self.lr > 0, "train.lr must be > 0")
        _check(
            self.micro_batch_size >= 1 and self.num_minibatches >= 1 and self.ppo_epochs >= 1,
            "train.micro_batch_size, train.num_minibatches and train.ppo_epochs must be ≥ 1",
        )


@dataclass
class ValConfig:
    every: int = opt(10, "Validate every N steps (0 = never) and at the end.")
    before_train: bool = opt(True, "Validate once before the first step.")
    prompts: str | None = opt("configs/prompts/val.txt", "Validation prompts file (null = no validation).")
    n: int = opt(2, "Samples per validation prompt.")
    num_steps: int = opt(20, "ODE steps for validation samples.")
    guidance: float | None = opt(None, "CFG for validation (null = sampling.guidance).")
    seed: int = opt(1234, "Seed of the validation noise (fixed across the run).")


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
    console_every: int = opt(10, "Console summary line every N steps (0 = never).")
    progress_bar: bool = opt(True, "Show a progress bar over training steps (only on a terminal).")


@dataclass
class EngineConfig:
    kind: Literal["local"] = opt("local", "Where the work runs: local (this process).")
    num_threads: int | None = opt(None, "torch CPU threads (null = torch's default).")


@dataclass
class Config:
    run: RunConfig = opt(RunConfig, "Run identity and resume.", factory=True)
    model: ModelConfig = opt(ModelConfig, "Model to train.", factory=True)
    sampling: SamplingConfig = opt(SamplingConfig, "Training rollouts.", factory=True)
    data: DataConfig = opt(DataConfig, "Prompts.", factory=True)
    rewards: list[RewardSpec] = opt(lambda: [RewardSpec()], "Rewards, summed with their weights.", factory=True)
    algorithm: AlgorithmConfig = opt(AlgorithmConfig, "Algorithm and loss.", factory=True)
    train: TrainConfig = opt(TrainConfig, "Optimisation.", factory=True)
    val: ValConfig = opt(ValConfig, "Validation.", factory=True)
    log: LogConfig = opt(LogConfig, "Metrics and trackers.", factory=True)
    engine: EngineConfig = opt(EngineConfig, "Execution engine.", factory=True)

    def __post_init__(self):
        batch = self.data.prompts_per_step * self.data.group_size
        minibatches = self.train.num_minibatches
        _check(
            batch % minibatches == 0,
            f"the batch (data.prompts_per_step × data.group_size = {batch}) must split evenly into "
            f"train.num_minibatches = {minibatches}",
        )
        w = self.sampling.window
        if w.kind == "random":
            hi = self.sampling.num_steps - 1 if w.hi is None else w.hi
            _check(
                w.size >= 1 and w.lo >= 0 and w.lo + w.size <= hi <= self.sampling.num_steps,
                f"sampling.window: need 1 ≤ size and lo + size ≤ hi ≤ num_steps; got size={w.size}, "
                f"lo={w.lo}, hi={hi}, num_steps={self.sampling.num_steps}",
            )
        if w.kind == "sliding":
            _check(
                1 <= w.size <= self.sampling.num_steps - 2,
                f"sampling.window: a sliding window stays inside [0, num_steps − 2): need 1 ≤ size ≤ "
                f"{self.sampling.num_steps - 2}, got size={w.size}",
            )
        from diffusion_rl.algorithms.losses import LOSSES

        alg = self.algorithm
        _check(alg.loss in LOSSES, f"algorithm.loss '{alg.loss}' is unknown; known: {', '.join(LOSSES.names())}")
        rc = alg.rollout_correction
        _check(
            rc.mode == "decoupled" or rc.rs_stat is None or rc.rs_level == "step",
            f"algorithm.rollout_correction: rs_level={rc.rs_level} needs every step's current log-prob before the "
            "update; use mode=decoupled, or rs_level=step with mode=bypass",
        )
        if alg.loss in SDE_ONLY_LOSSES:
            _check(
                self.sampling.sde_type == "sde",
                f"algorithm.loss={alg.loss} is defined for sampling.sde_type=sde, got {self.sampling.sde_type}",
            )
        _check(len(self.rewards) > 0, "rewards: at least one reward is needed")

    @property
    def batch_size(self) -> int:
        return self.data.prompts_per_step * self.data.group_size


def load(path: str | None, overrides: list[str] = ()) -> Config:
    return load_config(Config, path, list(overrides))
