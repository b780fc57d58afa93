"""The configuration: one typed dataclass tree, loaded from YAML plus dotted `key=value` overrides.

Every field has a default and a one-line help text; `__post_init__` rejects impossible values with a message
that says what to change. `diffusion-rl config show CONFIG` prints the resolved tree and
`docs/config.md` is generated from it (`diffusion-rl config reference`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from diffusion_rl.algorithms import LOSSES
from diffusion_rl.algorithms.rollout_correction import RolloutCorrectionConfig
from diffusion_rl.config_io import SECTIONS, load_config
from diffusion_rl.errors import did_you_mean
from diffusion_rl.guard.config import GuardConfig
from diffusion_rl.models.attention import backend_names
from diffusion_rl.models.registry import load_families
from diffusion_rl.settings import check, opt

logger = logging.getLogger(__name__)


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
        check(self.rank >= 1, f"lora.rank must be ≥ 1, got {self.rank}")


@dataclass
class ModelConfig:
    path: str = opt("models/tiny", "Local diffusers-format model directory.")
    family: str = opt("auto", f"Model family ({', '.join(load_families().names())}); auto reads model_index.json.")
    dtype: Literal["fp32", "bf16", "fp16"] = opt("fp32", "Weight dtype (SDE math is always fp32).")
    device: str = opt("auto", "auto, cpu, cuda or cuda:N.")
    lora: LoraConfig = opt(LoraConfig, "LoRA settings.", factory=True)
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    offload_frozen: bool = opt(
        False,
        "Memory saver: keep the frozen text encoders and VAE on the CPU, moving each to model.device only while it "
        "encodes prompts or decodes/encodes images (a host-device copy per use; outputs unchanged).",
    )
    offload_reference: bool = opt(
        False,
        "Memory saver, full fine-tuning: keep the frozen reference copy (the KL term's, DPO's) on the CPU, moving it "
        "to model.device only for its forward (a host-device copy of the transformer per reference forward). LoRA's "
        "reference is the base with the adapter disabled: no copy to offload.",
    )
    max_sequence_length: int = opt(256, "Text tokens per prompt (T5; Qwen-Image: the prompt after its template).")
    embedding_cache: str | None = opt(
        None,
        "Prompt-embedding cache: each distinct prompt and negative prompt of data.train/data.pairs and val.prompts "
        "through the text encoders once, then the encoders are released (no device memory). null = off; auto = "
        "<run.dir>/embedding_cache/; a folder: one file per model and text setting, filled on first use; a "
        "*.safetensors file: read only, made by `diffusion-rl prepare embeddings` (docs/models.md).",
    )
    create_tiny_if_missing: str | None = opt(
        None,
        "Create the tiny model of this preset (base, small, …) at model.path when the directory does not exist; "
        "of model.family (sd3 when auto).",
    )
    compile: bool = opt(
        False,
        "torch.compile the transformer for sampling (rollouts, validation; training passes stay eager): "
        "minutes of compiling on first use, then faster steps (see benchmarks/RESULTS.md).",
    )
    compile_blocks: bool = opt(
        False,
        "Regional compilation: torch.compile each repeated transformer block in place, so training passes (recompute "
        "forward and backward) and sampling both run compiled blocks; one block's compile time, not the network's "
        "(replaces model.compile's whole-network compile; see benchmarks/RESULTS.md).",
    )
    attention_backend: str = opt(
        "sdpa",
        "Attention kernel of the transformer through diffusers' dispatcher: sdpa (as diffusers builds it), native, "
        "_native_math, _native_flash, flash, _flash_3, sage, flex, xformers, … (`*_hub` ones are not offered); one "
        "whose package is missing is refused at load, naming the installed ones (models/attention.py).",
    )
    autocast: Literal["none", "bf16"] = opt(
        "none",
        "Precision policy. bf16: the transformer forward runs under torch.autocast(bf16) while the weights, gradients "
        "and optimizer state stay model.dtype (fp32 master weights); the SDE step and log-prob math stay fp32.",
    )

    def __post_init__(self):
        check(
            not (self.compile and self.compile_blocks),
            "model.compile and model.compile_blocks are alternatives: compile_blocks already compiles sampling",
        )
        check(
            self.autocast == "none" or self.dtype != "fp16",
            f"model.autocast={self.autocast} with model.dtype=fp16 mixes two half types; use model.dtype fp32 "
            "(fp32 master weights) or bf16",
        )
        check(
            not (self.offload_reference and self.lora.enabled),
            "model.offload_reference offloads full fine-tuning's reference copy; with model.lora.enabled the "
            "reference is the base model with the adapter disabled, no copy: set model.offload_reference=false",
        )
        backends = backend_names()
        check(
            self.attention_backend in backends,
            f"model.attention_backend '{self.attention_backend}' is not an attention backend"
            f"{did_you_mean(self.attention_backend, backends)}; known: {', '.join(backends)}",
        )
        names = load_families().names()
        check(
            self.family == "auto" or self.family in names,
            f"model.family '{self.family}' is not a model family{did_you_mean(self.family, names)}; known: auto, "
            + ", ".join(names),
        )

    @property
    def tiny_family(self) -> str:
        """The family of the tiny model create_tiny_if_missing makes: model.family, or sd3 when auto."""
        return "sd3" if self.family == "auto" else self.family


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
class TreePruneConfig:
    depths: list[int] | None = opt(
        None,
        "Depth pruning: the depths whose steps train (1 = the steps into the first split's children, …, D = the "
        "leaves'); the others sample but get no gradient. null = every depth 1..D.",
    )
    leaves: int | None = opt(
        None,
        "Width pruning: the leaf depth's steps train for only this many leaves per tree, the ⌈n/2⌉ highest and the "
        "⌊n/2⌋ lowest rewards; null = every leaf.",
    )


@dataclass
class TreeConfig:
    branch_at: list[int] = opt(
        list, "Steps at which every node splits (increasing; each an SDE step of sampling.window).", factory=True
    )
    branching: int | list[int] = opt(
        2, "Children of each split: one number for every split, or one per branch_at step (their product = group)."
    )
    prune: TreePruneConfig = opt(TreePruneConfig, "Which tree steps train (BranchGRPO's pruning).", factory=True)


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
    num_frames: int = opt(
        1, "Frames of each sample: 1 for images; a video family (wan) takes 4k + 1, e.g. 9, 33 or 81."
    )
    sde_type: Literal["sde", "cps", "dance_sde", "ode"] = opt(
        "sde", "Stochastic step inside the window; ode: deterministic sampling (direct_preference family only)."
    )
    noise_level: float = opt(0.7, "SDE noise level a (η for dance_sde).")
    ode_solver: Literal["euler", "dpm2", "ab2"] = opt(
        "euler",
        "Solver of the ODE steps outside the SDE window, one model call per step either way: euler (1st order); "
        "dpm2: DPM-Solver++(2M), as MixGRPO-Flash; ab2: 2-step Adams–Bashforth on the velocity (2nd order on "
        "σ-uniform schedules). SDE steps and log-probs are unchanged.",
    )
    window: WindowConfig = opt(WindowConfig, "Which steps are stochastic (and trained).", factory=True)
    share_initial_noise: bool = opt(False, "Same initial noise for every sample of a prompt's group.")
    score_chunks: int = opt(
        1, "Sample the batch in this many chunks, scoring each in the background while the next samples."
    )
    latents_dtype: Literal["fp32", "bf16", "fp16"] = opt(
        "fp32",
        "Memory saver: the dtype the kept trajectory stores its window latents and step means in (half the memory "
        "with bf16/fp16); log-probs stay fp32, and the window's samples are the rounded ones, so the update replays "
        "the rollout's log-probs exactly (sampling/storage.py).",
    )
    tree: TreeConfig | None = opt(
        None,
        "Tree rollouts (BranchGRPO): each prompt's group shares its prefix and splits at branch_at steps, with "
        "depth-wise advantages (docs/policy_gradient.md). null = flat rollouts.",
    )

    def __post_init__(self):
        if self.tree is not None:
            self._check_tree()
        check(self.num_steps >= 2, f"sampling.num_steps must be ≥ 2, got {self.num_steps}")
        check(self.num_frames >= 1, f"sampling.num_frames must be ≥ 1 (1 = images), got {self.num_frames}")
        check(self.noise_level >= 0, f"sampling.noise_level must be ≥ 0, got {self.noise_level}")
        check(self.guidance >= 1, f"sampling.guidance must be ≥ 1 (1 disables CFG), got {self.guidance}")
        check(self.score_chunks >= 1, f"sampling.score_chunks must be ≥ 1, got {self.score_chunks}")

    def _check_tree(self) -> None:
        t = self.tree
        at = list(t.branch_at)
        check(bool(at), "sampling.tree.branch_at is empty: name the steps to split at (e.g. [2, 5]), or set "
                        "sampling.tree to null for flat rollouts")  # fmt: skip
        check(
            all(0 <= k < self.num_steps - 1 for k in at) and all(a < b for a, b in zip(at, at[1:])),
            f"sampling.tree.branch_at={at}: steps must be strictly increasing and in [0, num_steps − 2] "
            f"(num_steps={self.num_steps}; the last step is an ODE step)",
        )
        factors = [t.branching] * len(at) if isinstance(t.branching, int) else list(t.branching)
        check(
            len(factors) == len(at) and all(b >= 2 for b in factors),
            f"sampling.tree.branching={t.branching}: give one number ≥ 2, or one per branch_at step ({len(at)})",
        )
        p = t.prune
        check(
            p.depths is None or (bool(p.depths) and all(1 <= d <= len(at) for d in p.depths)),
            f"sampling.tree.prune.depths={p.depths}: depths are 1..{len(at)} (one per split), and at least one",
        )
        check(
            p.leaves is None or 1 <= p.leaves <= math.prod(factors),
            f"sampling.tree.prune.leaves={p.leaves}: must be in [1, {math.prod(factors)}] (the leaves per tree)",
        )


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
        check(self.prompts_per_step >= 1, "data.prompts_per_step must be ≥ 1")
        check(self.group_size >= 1, "data.group_size must be ≥ 1")


@dataclass
class RewardSpec:
    name: str = opt("jpeg_incompressibility", "Registered reward name, or module:function / file.py:function.")
    label: str | None = opt(None, "Name in metrics and logs; default: name; must be unique.")
    weight: float = opt(1.0, "Weight in the weighted sum (finite, ≥ 0; 0 = scored and logged only).")
    required: bool = opt(True, "A failure of this reward fails the sample; false: left out and renormalised.")
    kwargs: dict[str, Any] = opt(dict, "Keyword arguments for the reward.", factory=True)
    frames: Literal["mean", "min", "first", "last"] = opt(
        "mean",
        "How an image reward scores a video: the mean or the min of its frames' scores, or the first or last "
        "frame's (a reward that scores whole videos, e.g. temporal_consistency, ignores it).",
    )
    actors: int = opt(
        0, "Score in this many Ray actors of the reward's own (model-based rewards); 0 = in the trainer process."
    )
    actor_cpus: float = opt(1.0, "CPUs each reward actor reserves.")
    actor_gpus: float = opt(0.0, "GPUs each reward actor reserves (a fraction shares a GPU between actors).")
    timeout_s: float | None = opt(
        1800.0,
        "Deadline of one call of the reward (a chunk; a sample when retried; a group): past it the call's samples "
        "fail, naming the reward, and the call's thread is abandoned. null = no deadline.",
    )

    def __post_init__(self):
        check(self.actors >= 0, f"rewards: actors must be ≥ 0 (0 = in the trainer process), got {self.actors}")
        check(
            self.timeout_s is None or (math.isfinite(self.timeout_s) and self.timeout_s > 0),
            f"rewards: timeout_s must be a number of seconds > 0 (or null = no deadline), got {self.timeout_s}",
        )
        check(self.actor_cpus >= 0 and self.actor_gpus >= 0, "rewards: actor_cpus and actor_gpus must be ≥ 0")
        check(
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
        check(
            not isinstance(self.std_ddof, bool) and isinstance(self.std_ddof, int) and self.std_ddof >= 0,
            f"algorithm.advantage.std_ddof must be an integer ≥ 0 (0: population std, 1: sample std), "
            f"got {self.std_ddof!r}",
        )
        check(
            0 <= self.eps < float("inf"),  # NaN fails too
            f"algorithm.advantage.eps must be a finite number ≥ 0, got {self.eps}",
        )


def _loss_sections() -> dict[str, type]:
    """Every registered loss's settings dataclass, by loss name: the sections algorithm.<loss>."""
    return {name: spec.settings for name, spec in LOSSES.items()}


# keys that lived in `algorithm` before each loss got its own section
_LOSS_SETTING_KEYS = ("clip_range", "adv_clip_max", "kl_beta", "kl_mask_threshold", "add_kl_coefficient", "dpo_beta",
                      "nft_beta", "old_update_interval", "old_decay", "old_decay_value", "train_timesteps",
                      "weighting", "advantage_max", "ema_beta")  # fmt: skip


@dataclass
class AlgorithmConfig:
    loss: str = opt(
        "flow_grpo",
        "The algorithm, by its registered loss (policy gradient on per-step SDE log-probs, or direct preference on "
        "final latents); every registered loss has its settings section algorithm.<loss>.",
    )
    timestep_fraction: float = opt(1.0, "Policy gradient: fraction of the window's steps trained per sample.")
    timestep_selection: Literal["first", "random"] = opt(
        "first", "Policy gradient: train the first steps (flow_grpo) or a seeded random subset per sample."
    )
    drop_zero_advantage: bool = opt(False, "Policy gradient: leave samples with advantage 0 out of the loss.")
    advantage: AdvantageConfig = opt(AdvantageConfig, "Group advantage normalisation.", factory=True)
    rollout_correction: RolloutCorrectionConfig = opt(
        RolloutCorrectionConfig,
        "Policy gradient: importance weights / rejection between rollout and trained policy.",
        factory=True,
    )
    losses: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            SECTIONS: _loss_sections,
            "help": "Settings of the loss `{key}`, read when algorithm.loss={key} (the others are ignored).",
        },
    )

    moved_keys: ClassVar[dict[str, str]] = {
        "family": "is gone: the family follows from algorithm.loss (dpo, nft and awm are direct-preference losses)",
        **{
            key: f"moved into the loss's own section: algorithm.<loss>.{key} (e.g. algorithm.flow_grpo.{key}; "
            "`diffusion-rl config reference` lists each loss's keys)"
            for key in _LOSS_SETTING_KEYS
        },
    }

    def __post_init__(self):
        check(
            self.loss in LOSSES,
            f"algorithm.loss '{self.loss}' is not a registered loss{did_you_mean(self.loss, LOSSES.names())}; "
            f"known: {', '.join(LOSSES.names())}",
        )
        # only the selected loss's section is kept (at its defaults when the config has none): the others were
        # checked, but a run never reads them, and a written config.yaml should not suggest it does
        self.losses = {self.loss: self.losses.get(self.loss) or LOSSES.get(self.loss).settings()}
        check(
            0 < self.timestep_fraction <= 1,
            f"algorithm.timestep_fraction must be in (0, 1], got {self.timestep_fraction}",
        )

    @property
    def settings(self):
        """The selected loss's settings (its section algorithm.<loss>)."""
        return self.losses[self.loss]

    @property
    def spec(self):
        """The selected loss's registration: its function, settings class, algorithm and constraints."""
        return LOSSES.get(self.loss)


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
    flops: bool = opt(
        True,
        "Count each step's FLOPs exactly (FlopCounterMode on the first rollout and update of each shape, cached) and "
        "log perf/flops_per_step, perf/images_per_s, perf/images_per_device_s and perf/mfu.",
    )
    peak_tflops: float | None = opt(
        None,
        "Peak dense bf16 TFLOP/s of one device for perf/mfu; null = the device table (H100/H200/H800/A100/L40S/A10/"
        "RTX 4090; docs/estimate.md). A CPU has no entry: set it to log MFU there.",
    )

    def __post_init__(self):
        check(self.rollout_every >= 0, f"log.rollout_every must be ≥ 0 (0 = off), got {self.rollout_every}")
        check(self.rollout_max_images >= 0, f"log.rollout_max_images must be ≥ 0, got {self.rollout_max_images}")
        check(
            self.peak_tflops is None or self.peak_tflops > 0,
            f"log.peak_tflops must be > 0 (or null = the device table), got {self.peak_tflops}",
        )


@dataclass
class ProfileConfig:
    steps: list[int] = opt(
        list, "Training steps to trace with torch.profiler (numbered as in metrics.jsonl, from 1).", factory=True
    )
    memory: bool = opt(False, "Also record a CUDA memory snapshot over the profiled steps (GPU only).")

    def __post_init__(self):
        bad = [s for s in self.steps if s < 1]
        check(not bad, f"profile.steps are training steps numbered from 1, got {bad}")
        check(len(set(self.steps)) == len(self.steps), f"profile.steps lists a step more than once: {self.steps}")


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
    fsdp_cpu_offload: bool = opt(
        False,
        "ray: memory saver: FSDP2's CPUOffloadPolicy; the transformer's shards, gradients and optimizer state live in "
        "host memory and each block is copied to the device when gathered (slower steps, least device memory).",
    )
    collective_timeout_s: float = opt(
        1800.0, "ray: a collective waiting this long for a lost or hung worker fails (the run stops, no checkpoint)."
    )
    start_timeout_s: float = opt(300.0, "ray: wait this long for the cluster to have the workers' CPUs and GPUs.")
    rollout: Literal["colocated", "separate"] = opt(
        "colocated",
        "ray: colocated: the workers sample and train in turn; separate: rollout_workers inference-only actors sample "
        "while the num_workers trainers train, and get the new weights after each update (docs/distributed.md).",
    )
    rollout_workers: int = opt(1, "separate: rollout actors (one device each); each samples 1/R of the batch.")
    cpus_per_rollout_worker: float = opt(1.0, "separate: CPUs each rollout actor reserves.")
    gpus_per_rollout_worker: float = opt(0.0, "separate: GPUs each rollout actor reserves (0 or 1).")
    rollout_dtype: Literal["fp32", "bf16", "fp16"] | None = opt(
        None, "separate: the rollout actors' model dtype (null = model.dtype); rollout correction covers the gap."
    )
    weight_sync: Literal["object_store", "broadcast"] = opt(
        "object_store",
        "separate: how new weights reach the rollout actors: through Ray's object store, or a torch.distributed "
        "broadcast from trainer rank 0 (NCCL on GPUs, gloo on CPUs). LoRA: only the adapter moves.",
    )
    sync_every: int = opt(1, "separate: push the weights to the rollout actors after every this many steps.")
    max_staleness: int = opt(
        0,
        "separate: rollouts of up to this many later steps are sampled while an update runs (0 = synchronous). Stale "
        "rows go through algorithm.rollout_correction, which is then set to decoupled if it was bypass.",
    )
    max_failures: int = opt(
        3, "ray: worker deaths survived per run (fresh actors, resume from the latest checkpoint); then the run stops."
    )
    trainer_resources: dict[str, float] = opt(
        dict, "ray: extra Ray resources each trainer reserves, e.g. {trainer_node: 1} to pin them.", factory=True
    )
    rollout_resources: dict[str, float] = opt(
        dict, "separate: extra Ray resources each rollout actor reserves, e.g. {rollout_node: 1}.", factory=True
    )

    def __post_init__(self):
        check(self.num_workers >= 1, f"engine.num_workers must be ≥ 1, got {self.num_workers}")
        check(
            self.rollout_workers >= 1 and self.cpus_per_rollout_worker > 0 and 0 <= self.gpus_per_rollout_worker <= 1,
            "engine.rollout_workers must be ≥ 1, engine.cpus_per_rollout_worker > 0 and engine.gpus_per_rollout_worker "
            f"in [0, 1]; got {self.rollout_workers}, {self.cpus_per_rollout_worker}, {self.gpus_per_rollout_worker}",
        )
        check(
            self.sync_every >= 1 and self.max_staleness >= 0 and self.max_failures >= 0,
            f"engine.sync_every must be ≥ 1 and engine.max_staleness, engine.max_failures ≥ 0; got {self.sync_every}, "
            f"{self.max_staleness}, {self.max_failures}",
        )
        check(
            self.rollout == "separate" or (self.max_staleness == 0 and self.sync_every == 1),
            "engine.max_staleness and engine.sync_every are for engine.rollout=separate (colocated workers always "
            "sample with the newest weights)",
        )
        check(
            self.rollout == "colocated" or self.kind == "ray",
            "engine.rollout=separate runs rollout actors beside the trainers: it needs engine.kind=ray",
        )
        check(
            self.cpus_per_worker > 0 and self.gpus_per_worker >= 0,
            f"engine.cpus_per_worker must be > 0 (a worker drives its device from a CPU) and engine.gpus_per_worker "
            f"≥ 0; got {self.cpus_per_worker} and {self.gpus_per_worker}",
        )
        check(
            self.kind == "ray" or not self.fsdp_cpu_offload,
            "engine.fsdp_cpu_offload offloads the FSDP2 shards of the Ray engine's trainers: it needs engine.kind=ray "
            "(the local engine does not shard; model.offload_frozen offloads its text encoders and VAE)",
        )
        check(
            self.collective_timeout_s > 0 and self.start_timeout_s > 0,
            "engine.collective_timeout_s and engine.start_timeout_s must be > 0",
        )
        check(
            self.address is None or self.address == "auto" or self.address.startswith("ray://") or ":" in self.address,
            f"engine.address={self.address!r}: use null (start Ray here), auto, ray://host:port or host:port",
        )

    @property
    def staleness_bound(self) -> int:
        """The most updates a training row's sampling weights can be behind the trained ones (0: always on-policy)."""
        return self.max_staleness + self.sync_every - 1 if self.rollout == "separate" else 0


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
    guard: GuardConfig = opt(GuardConfig, "Reward-hacking guard: image statistics no reward optimises.", factory=True)

    def __post_init__(self):
        check(
            not self.run.val_only or bool(self.val.prompts),
            "run.val_only=true validates and exits, but val.prompts is null: set val.prompts to a prompt file",
        )
        # every loss is group-relative (advantages normalised within a prompt's group; online dpo pairs two of its
        # samples): a group of one gives every sample advantage 0 and the run learns nothing
        check(
            self.data.group_size >= 2 or self.data.sample_source == "offline",
            f"data.group_size=1: algorithm.loss={self.algorithm.loss} compares the samples of each prompt's group "
            "(group-normalised advantages; online dpo: pairs within the group), so every advantage would be 0 and "
            "nothing is learned; set data.group_size to 2 or more",
        )
        batch = self.data.prompts_per_step * self.data.group_size
        minibatches = self.train.num_minibatches
        check(
            batch % minibatches == 0,
            f"the batch (data.prompts_per_step × data.group_size = {batch}) must split evenly into "
            f"train.num_minibatches = {minibatches}",
        )
        w = self.sampling.window
        if w.kind == "random":
            hi = self.sampling.num_steps - 1 if w.hi is None else w.hi
            check(
                w.size >= 1 and w.lo >= 0 and w.lo + w.size <= hi <= self.sampling.num_steps,
                f"sampling.window: need 1 ≤ size and lo + size ≤ hi ≤ num_steps; got size={w.size}, "
                f"lo={w.lo}, hi={hi}, num_steps={self.sampling.num_steps}",
            )
        if w.kind == "sliding":
            check(
                1 <= w.size <= self.sampling.num_steps - 2,
                f"sampling.window: a sliding window stays inside [0, num_steps − 2): need 1 ≤ size ≤ "
                f"{self.sampling.num_steps - 2}, got size={w.size}",
            )
        alg = self.algorithm
        self._check_algorithm()
        self._check_tree()
        self._check_engine()
        rc = alg.rollout_correction
        for c in rc.criteria:
            check(
                rc.mode == "decoupled" or c.level == "step",
                f"algorithm.rollout_correction: rs_level={c.level} (criterion {c.name}) needs every step's current "
                "log-prob before the update; use mode=decoupled, or level step with mode=bypass",
            )
        check(
            len(self.rewards) > 0 or self.data.sample_source == "offline",
            "rewards: at least one reward is needed (only offline DPO trains without one)",
        )
        self._check_rewards()

    def _check_rewards(self) -> None:
        """Each weight is finite and ≥ 0; each reward's metric name (label, else name) is unique (also val.rewards)."""
        lists = [("rewards", self.rewards)]
        if self.val.rewards is not None:
            check(bool(self.val.rewards), "val.rewards is an empty list; give at least one reward, or null")
            lists.append(("val.rewards", self.val.rewards))
        for where, specs in lists:
            for i, spec in enumerate(specs):
                check(
                    math.isfinite(spec.weight) and spec.weight >= 0,
                    f"{where}.{i}.weight must be a finite number ≥ 0, got {spec.weight}; to minimise a score, use a "
                    "reward that negates it",
                )
            first_of: dict[str, int] = {}
            for i, spec in enumerate(specs):
                key = spec.metric_name
                if key in first_of:
                    raise ValueError(
                        f"{where}.{first_of[key]} and {where}.{i} are both '{key}' in metrics and logs (the label, "
                        f"else the name, must be unique): give one of them its own label, e.g. "
                        f"{where}.{i}.label={key}_2"
                    )
                first_of[key] = i

    def _check_engine(self) -> None:
        """engine.kind=ray splits the batch into equal contiguous shards whose mini-batches make up the global ones."""
        e, batch, minibatches = self.engine, self.batch_size, self.train.num_minibatches
        if e.kind != "ray":
            return
        check(
            not self.model.offload_reference,
            "model.offload_reference moves the local engine's reference copy; under engine.kind=ray that copy is "
            "FSDP2-sharded: use engine.fsdp_cpu_offload=true to keep its shards (and the trained ones) on the CPU",
        )
        check(
            e.rollout == "colocated" or self.data.sample_source == "online",
            "engine.rollout=separate samples online rollouts; offline pairs (data.sample_source=offline) train with "
            "engine.rollout=colocated",
        )
        rc = self.algorithm.rollout_correction
        if e.staleness_bound > 0 and self.algorithm.spec.family == "policy_gradient" and rc.mode == "bypass":
            # rows sampled by older weights: the PPO anchor is the current weights, the IS weight corrects the rest
            logger.info(
                "engine.max_staleness=%d, sync_every=%d: rows may be up to %d updates stale; "
                "algorithm.rollout_correction.mode set to decoupled",
                e.max_staleness,
                e.sync_every,
                e.staleness_bound,
            )
            rc.mode = "decoupled"
        check(
            batch % e.num_workers == 0 and (batch // e.num_workers) % minibatches == 0,
            f"engine.num_workers={e.num_workers}: each worker trains on batch / num_workers rows, which must be a "
            f"whole number divisible by train.num_minibatches={minibatches} (batch = data.prompts_per_step × "
            f"data.group_size = {batch}, offline: 2 × data.prompts_per_step); pick num_workers dividing "
            f"{batch // minibatches}",
        )

    def _check_tree(self) -> None:
        """Tree rollouts: a group is one tree's leaves, sampled whole by one local policy-gradient worker."""
        tree = self.sampling.tree
        if tree is None:
            return
        leaves = math.prod([tree.branching] * len(tree.branch_at) if isinstance(tree.branching, int)
                           else tree.branching)  # fmt: skip
        check(
            self.data.group_size == leaves,
            f"sampling.tree: a group is one tree's leaves, the product of sampling.tree.branching = {leaves}; set "
            f"data.group_size={leaves} (got {self.data.group_size})",
        )
        check(
            self.engine.kind == "local",
            "sampling.tree runs on engine.kind=local only (Ray workers split a step's rows, and a tree must be sampled "
            "whole by one worker); set engine.kind=local or sampling.tree=null",
        )
        check(
            self.algorithm.spec.family == "policy_gradient" and self.data.sample_source == "online",
            f"sampling.tree trains policy-gradient losses (depth-wise advantages on per-step log-probs); "
            f"algorithm.loss={self.algorithm.loss} is {self.algorithm.spec.family}",
        )
        check(
            self.algorithm.advantage.combine == "sum_rewards",
            "sampling.tree normalises the weighted reward sum at each depth; algorithm.advantage.combine="
            "sum_advantages is not implemented for trees (use sum_rewards)",
        )
        check(
            self.data.prompts_per_step % self.sampling.score_chunks == 0,
            f"sampling.tree samples whole trees: sampling.score_chunks={self.sampling.score_chunks} must divide "
            f"data.prompts_per_step={self.data.prompts_per_step}",
        )
        w = self.sampling.window
        if w.kind == "all":  # the other kinds move: each step's window is checked when it is drawn
            check(
                self.sampling.sde_type != "ode",
                "sampling.tree needs SDE steps to split at; sampling.sde_type=ode has none",
            )

    def _check_algorithm(self) -> None:
        """The selected loss's own constraints, its family's, and its settings' on the rest of the config."""
        spec = self.algorithm.spec
        check(
            not spec.sde_only or self.sampling.sde_type == "sde",
            f"algorithm.loss={spec.name} is defined for sampling.sde_type=sde, got {self.sampling.sde_type}",
        )
        spec.algorithm.check_config(self)
        self.algorithm.settings.check_config(self)
        if self.data.sample_source == "offline":
            check(bool(self.data.pairs), "data.sample_source=offline needs data.pairs (a .jsonl or .parquet pair file)")

    @property
    def batch_size(self) -> int:
        """Rows of a training step: prompts × group size; offline pairs: chosen and rejected of each."""
        if self.data.sample_source == "offline":
            return 2 * self.data.prompts_per_step
        return self.data.prompts_per_step * self.data.group_size


def load(path: str | None, overrides: list[str] = ()) -> Config:
    return load_config(Config, path, list(overrides))
