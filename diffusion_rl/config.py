"""The configuration: one typed dataclass tree, loaded from YAML plus dotted `key=value` overrides.

Every field has a default and a one-line help text; `__post_init__` rejects impossible values with a message
that says what to change. `diffusion-rl config show CONFIG` prints the resolved tree and
`docs/config.md` is generated from it (`diffusion-rl config reference`).
"""

from __future__ import annotations

import math
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
    val_only: bool = opt(
        False,
        "Validate the resumed checkpoint (or the initial model) and exit without training: the grid and a JSON "
        "of the numbers go to <run.dir>/samples/step_XXXXXX.{png,json}.",
    )


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
    family: Literal["auto", "sd3", "flux", "qwen_image"] = opt("auto", "Model family; auto reads model_index.json.")
    dtype: Literal["fp32", "bf16", "fp16"] = opt("fp32", "Weight dtype (SDE math is always fp32).")
    device: str = opt("auto", "auto, cpu, cuda or cuda:N.")
    lora: LoraConfig = opt(LoraConfig, "LoRA settings.", factory=True)
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    max_sequence_length: int = opt(256, "Text tokens per prompt (T5; Qwen-Image: the prompt after its template).")
    create_tiny_if_missing: Literal["base", "small"] | None = opt(
        None, "Create the tiny model of this preset at model.path when the directory does not exist."
    )
    compile: bool = opt(
        False,
        "torch.compile the transformer for sampling (rollouts, validation; training passes stay eager): "
        "minutes of compiling on first use, then faster steps (see benchmarks/RESULTS.md).",
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
    guidance: float = opt(
        4.5,
        "Classifier-free guidance scale (1 = no CFG: one forward per step); FLUX.1-dev: its distilled guidance "
        "embedding (always one forward).",
    )
    height: int = opt(64, "Image height in pixels.")
    width: int = opt(64, "Image width in pixels.")
    sde_type: Literal["sde", "cps", "dance_sde", "ode"] = opt(
        "sde", "Stochastic step inside the window; ode: deterministic sampling (direct_preference family only)."
    )
    noise_level: float = opt(0.7, "SDE noise level a (η for dance_sde).")
    window: WindowConfig = opt(WindowConfig, "Which steps are stochastic (and trained).", factory=True)
    share_initial_noise: bool = opt(False, "Same initial noise for every sample of a prompt's group.")
    score_chunks: int = opt(
        1, "Sample the batch in this many chunks, scoring each in the background while the next samples."
    )

    def __post_init__(self):
        _check(self.num_steps >= 2, f"sampling.num_steps must be ≥ 2, got {self.num_steps}")
        _check(self.noise_level >= 0, f"sampling.noise_level must be ≥ 0, got {self.noise_level}")
        _check(self.guidance >= 1, f"sampling.guidance must be ≥ 1 (1 disables CFG), got {self.guidance}")
        _check(self.score_chunks >= 1, f"sampling.score_chunks must be ≥ 1, got {self.score_chunks}")


@dataclass
class DataConfig:
    train: str = opt("configs/prompts/quickstart.txt", "Training prompts: .txt, .jsonl or .parquet.")
    prompts_per_step: int = opt(2, "Distinct prompts per training step.")
    group_size: int = opt(4, "Samples per prompt (the group for advantages).")
    shuffle: bool = opt(True, "Shuffle prompt order each epoch (seeded).")
    sample_source: Literal["online", "offline"] = opt(
        "online",
        "online: sample and score the current model each step; offline: Diffusion-DPO on the pair dataset "
        "data.pairs (no sampling, no reward for training; data.prompts_per_step pairs per step).",
    )
    pairs: str | None = opt(
        None,
        "Offline pair dataset (.jsonl or .parquet): prompt, chosen and rejected image paths (relative to the file), "
        "optional negative_prompt, chosen_score, rejected_score. Made by `diffusion-rl prepare pairs`.",
    )

    def __post_init__(self):
        _check(self.prompts_per_step >= 1, "data.prompts_per_step must be ≥ 1")
        _check(self.group_size >= 1, "data.group_size must be ≥ 1")


@dataclass
class RewardSpec:
    name: str = opt("jpeg_incompressibility", "Registered reward name, or module:function / file.py:function.")
    label: str | None = opt(None, "Name in metrics and logs; default: name; must be unique.")
    weight: float = opt(1.0, "Weight in the weighted sum (finite, ≥ 0; 0 = scored and logged only).")
    required: bool = opt(True, "A failure of this reward fails the sample; false: left out and renormalised.")
    kwargs: dict[str, Any] = opt(dict, "Keyword arguments for the reward.", factory=True)
    actors: int = opt(
        0, "Score in this many Ray actors of the reward's own (model-based rewards); 0 = in the trainer process."
    )
    actor_cpus: float = opt(1.0, "CPUs each reward actor reserves.")
    actor_gpus: float = opt(0.0, "GPUs each reward actor reserves (a fraction shares a GPU between actors).")

    def __post_init__(self):
        _check(self.actors >= 0, f"rewards: actors must be ≥ 0 (0 = in the trainer process), got {self.actors}")
        _check(self.actor_cpus >= 0 and self.actor_gpus >= 0, "rewards: actor_cpus and actor_gpus must be ≥ 0")
        _check(
            self.label is None or bool(self.label.strip()),
            f"rewards: label must be a non-blank name (or null = the reward's name), got {self.label!r}",
        )

    @property
    def metric_name(self) -> str:
        """The reward's name in metrics (reward/<metric_name>/mean) and logs: its label, else its name."""
        return self.label if self.label is not None else self.name


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

    def __post_init__(self):
        # what compute_advantages accepts (a std undefined for too few rewards gives advantage 0; eps 0 is safe)
        _check(
            not isinstance(self.std_ddof, bool) and isinstance(self.std_ddof, int) and self.std_ddof >= 0,
            f"algorithm.advantage.std_ddof must be an integer ≥ 0 (0: population std, 1: sample std), "
            f"got {self.std_ddof!r}",
        )
        _check(
            0 <= self.eps < float("inf"),  # NaN fails too
            f"algorithm.advantage.eps must be a finite number ≥ 0, got {self.eps}",
        )


# losses whose formulas assume the Flow-GRPO `sde` step (std_dev_t and √dt of that step)
SDE_ONLY_LOSSES = ("grpo_guard", "flow_dppo")

# algorithm fields whose null default depends on the loss (None: every other loss): the loss's reference recipe
LOSS_DEFAULTS: dict[str, dict[str | None, float]] = {
    "clip_range": {"awm": 1.0, None: 1e-4},  # AWM's recipes; Flow-GRPO's 1e-4 would clip nearly every AWM row
    "kl_beta": {"nft": 1e-4, None: 0.0},  # DiffusionNFT's
    "timestep_fraction": {"nft": 0.99, None: 1.0},  # DiffusionNFT's
}


@dataclass
class AlgorithmConfig:
    family: Literal["policy_gradient", "direct_preference"] = opt(
        "policy_gradient",
        "policy_gradient: per-step log-probs of an SDE sampler (flow_grpo, grpo_guard, flow_dppo); "
        "direct_preference: re-noise the rollouts' final latents and regress velocities (dpo, nft, awm).",
    )
    loss: str = opt("flow_grpo", "Registered loss of the family (see `family` for the names).")
    clip_range: float | None = opt(None, "PPO ratio clip range (null = the loss's default: 1 for awm, else 1e-4).")
    adv_clip_max: float = opt(5.0, "Advantages are clamped to ±this inside the loss.")
    kl_beta: float | None = opt(
        None, "Weight of the KL to the reference policy (0 = off, no reference forward; null = 1e-4 for nft, else 0)."
    )
    timestep_fraction: float | None = opt(
        None,
        "Fraction of the window's (nft, awm: the rollout's) steps trained per sample (null = 0.99 for nft, else 1).",
    )
    timestep_selection: Literal["first", "random"] = opt("first", "first (flow_grpo) or a seeded random subset.")
    drop_zero_advantage: bool = opt(False, "Leave samples with advantage 0 out of the loss.")
    kl_mask_threshold: float = opt(1e-5, "flow_dppo: mask a sample moving further when its KL to the rollout ≥ this.")
    add_kl_coefficient: bool = opt(True, "flow_dppo: divide the mean gap by 2(std·√dt)² (false: by 2).")
    advantage: AdvantageConfig = opt(AdvantageConfig, "Group advantage normalisation.", factory=True)
    rollout_correction: RolloutCorrectionConfig = opt(
        RolloutCorrectionConfig, "Importance weights / rejection between rollout and trained policy.", factory=True
    )
    # direct_preference family (diffusion_rl/algorithms/preference/)
    dpo_beta: float = opt(2000.0, "dpo: β of Diffusion-DPO (flow models use ~100–5000).")
    nft_beta: float = opt(1.0, "nft: β of the implicit policies v± = old ± β·(v_θ − old) (0.1 in NFT's OCR recipe).")
    old_update_interval: int = opt(1, "nft: update the `old` adapter (which samples) every N training steps.")
    old_decay: Literal["copy", "linear_to_0_5", "delayed_linear_to_0_999", "fixed"] = opt(
        "delayed_linear_to_0_999",
        "nft: d of old ← d·old + (1 − d)·θ after `step` completed steps: copy (0), linear_to_0_5 "
        "(min(0.001·step, 0.5)), delayed_linear_to_0_999 (0 before step 75, then min(0.0075·(step − 75), 0.999)), "
        "fixed (old_decay_value).",
    )
    old_decay_value: float | None = opt(None, "nft: the constant d in [0, 1] of old_decay=fixed.")
    train_timesteps: int = opt(6, "awm: step indices trained per mini-batch, one from each of this many strata.")
    weighting: Literal["uniform", "t", "ghuber"] = opt(
        "ghuber", "awm: log p̂ = −w(mse, t): uniform (mse), t (t·mse), ghuber (t·((mse + 1e-10)^¼ − 1e-10^¼)·4)."
    )
    advantage_max: float = opt(1.0, "awm: advantages are clamped to ±adv_clip_max, then scaled to ±this.")
    ema_beta: float = opt(
        0.0, "awm: weight of mean (v_θ − v_ema)² (> 0 keeps an `ema` adapter, d = min(0.3, 0.001·step))."
    )

    def __post_init__(self):
        for name, by_loss in LOSS_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, by_loss.get(self.loss, by_loss[None]))
        _check(
            0 < self.timestep_fraction <= 1,
            f"algorithm.timestep_fraction must be in (0, 1], got {self.timestep_fraction}",
        )
        _check(self.clip_range > 0, "algorithm.clip_range must be > 0")
        _check(self.kl_beta >= 0, "algorithm.kl_beta must be ≥ 0")
        _check(self.adv_clip_max > 0, f"algorithm.adv_clip_max must be > 0, got {self.adv_clip_max}")
        _check(self.kl_mask_threshold >= 0, f"algorithm.kl_mask_threshold must be ≥ 0, got {self.kl_mask_threshold}")
        # GRPO-Guard's s = mean(√dt)·mean(std) is over a micro-batch's rows; the update's k-th backward pass holds
        # every row's k-th trained step, which is one step for all rows only with `first`
        _check(
            self.loss != "grpo_guard" or self.timestep_selection == "first",
            "algorithm.loss=grpo_guard needs algorithm.timestep_selection=first: its scale s = mean(√dt)·mean(std) "
            "over a micro-batch's rows assumes they are all at one step, and random trains a different subset of "
            "steps per sample",
        )
        for name in ("dpo_beta", "nft_beta", "advantage_max"):
            _check(getattr(self, name) > 0, f"algorithm.{name} must be > 0, got {getattr(self, name)}")
        _check(self.ema_beta >= 0, f"algorithm.ema_beta must be ≥ 0, got {self.ema_beta}")
        _check(self.train_timesteps >= 1, f"algorithm.train_timesteps must be ≥ 1, got {self.train_timesteps}")
        _check(
            self.old_update_interval >= 1, f"algorithm.old_update_interval must be ≥ 1, got {self.old_update_interval}"
        )
        if self.old_decay == "fixed":
            d = self.old_decay_value
            _check(d is not None and 0 <= d <= 1, f"algorithm.old_decay=fixed needs old_decay_value in [0, 1], got {d}")
        else:
            _check(
                self.old_decay_value is None,
                f"algorithm.old_decay_value={self.old_decay_value} only goes with old_decay=fixed (got "
                f"old_decay={self.old_decay}); set old_decay=fixed or remove old_decay_value",
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
        _check(self.total_steps >= 0, "train.total_steps must be ≥ 0")
        _check(self.lr > 0, "train.lr must be > 0")
        _check(self.save_every >= 0, f"train.save_every must be ≥ 0 (0 = only at the end), got {self.save_every}")
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
    rollout_every: int = opt(
        0, "Every N steps write the training rollout (images, prompts, rewards, advantages) to <run.dir>/rollouts/."
    )
    rollout_max_images: int = opt(16, "Images kept per rollout dump (the first ones: whole groups); JSONL has all.")

    def __post_init__(self):
        _check(self.rollout_every >= 0, f"log.rollout_every must be ≥ 0 (0 = off), got {self.rollout_every}")
        _check(self.rollout_max_images >= 0, f"log.rollout_max_images must be ≥ 0, got {self.rollout_max_images}")


@dataclass
class ProfileConfig:
    steps: list[int] = opt(
        list, "Training steps to trace with torch.profiler (numbered as in metrics.jsonl, from 1).", factory=True
    )
    memory: bool = opt(False, "Also record a CUDA memory snapshot over the profiled steps (GPU only).")

    def __post_init__(self):
        bad = [s for s in self.steps if s < 1]
        _check(not bad, f"profile.steps are training steps numbered from 1, got {bad}")
        _check(len(set(self.steps)) == len(self.steps), f"profile.steps lists a step more than once: {self.steps}")


@dataclass
class EngineConfig:
    kind: Literal["local", "ray"] = opt(
        "local", "Where the work runs: local (this process) or ray (PolicyWorker actors, transformer FSDP2-sharded)."
    )
    num_threads: int | None = opt(
        None, "torch CPU threads of the trainer process (null = torch's default); Ray workers use cpus_per_worker."
    )
    num_workers: int = opt(2, "ray: PolicyWorker actors (one per GPU); each samples and trains on 1/N of the batch.")
    cpus_per_worker: float = opt(1.0, "ray: CPUs each worker reserves.")
    gpus_per_worker: float = opt(0.0, "ray: GPUs each worker reserves (1 on GPUs: NCCL; 0: CPU workers with gloo).")
    address: str | None = opt(
        None, "ray: null starts Ray here; auto joins this node's cluster (`ray start`); ray://host:10001 a remote one."
    )
    mixed_precision: Literal["none", "bf16"] = opt(
        "none", "ray: FSDP2 mixed precision; bf16: bf16 compute and all-gathers, fp32 gradient reduction."
    )
    reshard_after_forward: bool = opt(
        False,
        "ray: FSDP2's ZeRO-3 schedule, the least memory: gather the weights for every forward and backward, reduce "
        "gradients after every backward. false: gather once and reduce once per optimizer step (full weights and "
        "gradients on each device during the update; far fewer collectives).",
    )
    collective_timeout_s: float = opt(
        1800.0, "ray: a collective waiting this long for a lost or hung worker fails (the run stops, no checkpoint)."
    )
    start_timeout_s: float = opt(300.0, "ray: wait this long for the cluster to have the workers' CPUs and GPUs.")

    def __post_init__(self):
        _check(self.num_workers >= 1, f"engine.num_workers must be ≥ 1, got {self.num_workers}")
        _check(
            self.cpus_per_worker > 0 and self.gpus_per_worker >= 0,
            f"engine.cpus_per_worker must be > 0 (a worker drives its device from a CPU) and engine.gpus_per_worker "
            f"≥ 0; got {self.cpus_per_worker} and {self.gpus_per_worker}",
        )
        _check(
            self.collective_timeout_s > 0 and self.start_timeout_s > 0,
            "engine.collective_timeout_s and engine.start_timeout_s must be > 0",
        )
        _check(
            self.address is None or self.address == "auto" or self.address.startswith("ray://") or ":" in self.address,
            f"engine.address={self.address!r}: use null (start Ray here), auto, ray://host:port or host:port",
        )


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
    profile: ProfileConfig = opt(ProfileConfig, "torch.profiler traces of chosen steps.", factory=True)

    def __post_init__(self):
        _check(
            not self.run.val_only or bool(self.val.prompts),
            "run.val_only=true validates and exits, but val.prompts is null: set val.prompts to a prompt file",
        )
        # every loss is group-relative (advantages normalised within a prompt's group; online dpo pairs two of its
        # samples): a group of one gives every sample advantage 0 and the run learns nothing
        _check(
            self.data.group_size >= 2 or self.data.sample_source == "offline",
            f"data.group_size=1: algorithm.loss={self.algorithm.loss} compares the samples of each prompt's group "
            "(group-normalised advantages; online dpo: pairs within the group), so every advantage would be 0 and "
            "nothing is learned; set data.group_size to 2 or more",
        )
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
        alg = self.algorithm
        self._check_family()
        self._check_engine()
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
        _check(
            len(self.rewards) > 0 or self.data.sample_source == "offline",
            "rewards: at least one reward is needed (only offline DPO trains without one)",
        )
        self._check_rewards()

    def _check_rewards(self) -> None:
        """Each weight is finite and ≥ 0; each reward's metric name (label, else name) is unique."""
        for i, spec in enumerate(self.rewards):
            _check(
                math.isfinite(spec.weight) and spec.weight >= 0,
                f"rewards.{i}.weight must be a finite number ≥ 0, got {spec.weight}; to minimise a score, use a "
                "reward that negates it",
            )
        first_of: dict[str, int] = {}
        for i, spec in enumerate(self.rewards):
            key = spec.metric_name
            if key in first_of:
                raise ValueError(
                    f"rewards.{first_of[key]} and rewards.{i} are both '{key}' in metrics and logs (the label, else "
                    f"the name, must be unique): give one of them its own label, e.g. rewards.{i}.label={key}_2"
                )
            first_of[key] = i

    def _check_engine(self) -> None:
        """engine.kind=ray splits the batch into equal contiguous shards whose mini-batches make up the global ones."""
        e, batch, minibatches = self.engine, self.batch_size, self.train.num_minibatches
        if e.kind != "ray":
            return
        _check(
            batch % e.num_workers == 0 and (batch // e.num_workers) % minibatches == 0,
            f"engine.num_workers={e.num_workers}: each worker trains on batch / num_workers rows, which must be a "
            f"whole number divisible by train.num_minibatches={minibatches} (batch = data.prompts_per_step × "
            f"data.group_size = {batch}); pick num_workers dividing {batch // minibatches}",
        )
        _check(
            self.algorithm.family == "policy_gradient",
            f"engine.kind=ray runs algorithm.family=policy_gradient; {self.algorithm.family} needs engine.kind=local",
        )

    def _check_family(self) -> None:
        """The loss belongs to the family's registry; sampling and data settings suit the family."""
        from diffusion_rl.algorithms.losses import LOSSES
        from diffusion_rl.algorithms.preference import PREFERENCE_LOSSES

        alg, s, data = self.algorithm, self.sampling, self.data
        registries = {"policy_gradient": LOSSES, "direct_preference": PREFERENCE_LOSSES}
        known = registries[alg.family]
        if alg.loss not in known:
            other = next((f for f, r in registries.items() if f != alg.family and alg.loss in r), None)
            hint = f"; it is a {other} loss: set algorithm.family={other}" if other else ""
            raise ValueError(
                f"algorithm.loss '{alg.loss}' is not a {alg.family} loss (known: {', '.join(known.names())}){hint}"
            )
        if alg.family == "policy_gradient":
            _check(
                s.sde_type != "ode",
                "sampling.sde_type=ode has no per-step log-probs for a policy-gradient loss; use sde, cps or dance_sde "
                "(or algorithm.family=direct_preference)",
            )
            _check(
                data.sample_source == "online",
                "data.sample_source=offline needs algorithm.family=direct_preference and algorithm.loss=dpo",
            )
            return
        _check(
            s.window.kind == "all",
            f"sampling.window.kind={s.window.kind} selects the steps a policy-gradient loss trains; the "
            "direct_preference family trains on final latents: use window.kind=all (sde_type=ode for pure ODE)",
        )
        rc = alg.rollout_correction
        _check(
            rc.mode == "bypass" and rc.rs_stat is None,
            "algorithm.rollout_correction applies to the policy_gradient family; leave it at its defaults",
        )
        if alg.loss == "awm":
            candidates = int(s.num_steps * alg.timestep_fraction) - 1
            _check(
                alg.train_timesteps <= candidates,
                f"algorithm.train_timesteps={alg.train_timesteps}: awm draws that many distinct steps from "
                f"1..{candidates} (int(sampling.num_steps × timestep_fraction) − 1); lower it or raise "
                "sampling.num_steps",
            )
        if data.sample_source == "offline":
            _check(alg.loss == "dpo", f"data.sample_source=offline trains algorithm.loss=dpo only, got {alg.loss}")
            _check(bool(data.pairs), "data.sample_source=offline needs data.pairs (a .jsonl or .parquet pair file)")

    @property
    def batch_size(self) -> int:
        return self.data.prompts_per_step * self.data.group_size


def load(path: str | None, overrides: list[str] = ()) -> Config:
    return load_config(Config, path, list(overrides))
