"""The pretraining (SFT) config: its own dataclass tree, separate from the RL `Config`.

Loaded the same strict way (unknown keys and bad values are errors that name the key):

    diffusion-rl pretrain configs/shapes_pretrain.yaml [dotted.key=value ...]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from diffusion_rl.config.fields import check, opt
from diffusion_rl.config.loading import load_config


@dataclass
class PretrainRunConfig:
    dir: str = opt("runs/shapes_pretrain", "Run directory: checkpoints, metrics.jsonl, sample grids.")
    out: str = opt("models/shapes", "Where the finished model is written (diffusers format).")
    seed: int = opt(0, "Seed of the model's initial weights and of every random draw of the run.")
    resume: str = opt(
        "auto",
        "auto (latest checkpoint in run.dir if any), never (start over: an earlier run in run.dir is moved aside to "
        "<run.dir>.before-<time>), or a checkpoint directory.",
    )
    num_threads: int | None = opt(2, "torch CPU threads (null = torch's default).")


@dataclass
class PretrainModelConfig:
    preset: Literal["base", "small"] = opt("base", "Tiny-model preset of the transformer and text encoders.")
    size: int = opt(32, "Image size in pixels (a multiple of 8).")
    text_tokens: int = opt(48, "Tokens per prompt for CLIP and T5 (ShapesWorld prompts need ≤ 42).")
    vae_channels: list[int] = opt(lambda: [16, 32, 32], "VAE block widths (3 blocks: 4× down-sampling).", factory=True)

    def __post_init__(self):
        check(self.size % 8 == 0 and self.size >= 16, f"model.size must be a multiple of 8 and ≥ 16, got {self.size}")
        check(8 <= self.text_tokens <= 77, f"model.text_tokens must be in [8, 77], got {self.text_tokens}")
        check(
            len(self.vae_channels) == 3 and all(c > 0 and c % 8 == 0 for c in self.vae_channels),
            f"model.vae_channels must be 3 multiples of 8 (the VAE normalises in groups of 8), got {self.vae_channels}",
        )


@dataclass
class ShapesDataConfig:
    split_seed: int = opt(0, "Seed of the train / held-out split of the ShapesWorld prompts.")
    heldout_fraction: float = opt(0.15, "Share of each kind of prompt held out of training.")

    def __post_init__(self):
        check(0 < self.heldout_fraction < 1, f"data.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")


@dataclass
class VaePhaseConfig:
    steps: int = opt(500, "VAE training steps (reconstruction of fresh ShapesWorld images each step).")
    batch_size: int = opt(32, "Images per VAE step.")
    lr: float = opt(2e-3, "AdamW learning rate of the VAE.")
    kl_weight: float = opt(1e-4, "Weight of the KL to N(0, I), per latent element (keeps latents bounded).")
    stats_images: int = opt(512, "Images whose latents set the VAE's shift and scale (latents ≈ zero mean, unit std).")

    def __post_init__(self):
        check(self.steps >= 1 and self.batch_size >= 1, "vae.steps and vae.batch_size must be ≥ 1")
        check(self.lr > 0 and self.kl_weight >= 0, "vae.lr must be > 0 and vae.kl_weight ≥ 0")


@dataclass
class FlowPhaseConfig:
    steps: int = opt(2500, "Flow-matching steps of the transformer.")
    batch_size: int = opt(32, "Samples per step.")
    lr: float = opt(1e-3, "AdamW peak learning rate.")
    min_lr_ratio: float = opt(0.1, "The cosine schedule ends at lr × this.")
    warmup_steps: int = opt(100, "Linear warm-up steps.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    grad_clip: float = opt(1.0, "Clip the gradient norm to this (0 = off).")
    cond_dropout: float = opt(0.1, "Share of samples trained with the empty prompt (what CFG needs).")
    logit_mean: float = opt(0.0, "σ = sigmoid(n), n ~ N(logit_mean, logit_std²): SD3's logit-normal timesteps.")
    logit_std: float = opt(1.0, "See logit_mean.")
    latent_pool: int = opt(8192, "Training images, encoded once by the frozen VAE (drawn from the pool each step).")
    ema_decay: float = opt(0.998, "EMA of the transformer's weights; the EMA is what gets exported (0 = off).")

    def __post_init__(self):
        check(self.steps >= 0 and self.batch_size >= 1, "flow.steps must be ≥ 0 and flow.batch_size ≥ 1")
        check(self.lr > 0, "flow.lr must be > 0")
        check(0 <= self.min_lr_ratio <= 1, "flow.min_lr_ratio must be in [0, 1]")
        check(0 <= self.cond_dropout < 1, "flow.cond_dropout must be in [0, 1)")
        check(self.logit_std > 0, "flow.logit_std must be > 0")
        check(self.latent_pool >= self.batch_size, "flow.latent_pool must be ≥ flow.batch_size")
        check(0 <= self.ema_decay < 1, "flow.ema_decay must be in [0, 1)")


@dataclass
class PretrainEvalConfig:
    every: int = opt(500, "Score ODE samples of held-out prompts every N flow steps (0 = only at the end).")
    prompts: int = opt(32, "Held-out prompts scored (a kind-balanced subset).")
    n: int = opt(2, "Samples per prompt.")
    num_steps: int = opt(20, "ODE steps per sample.")
    guidance: float = opt(4.5, "Classifier-free guidance.")
    seed: int = opt(1234, "Seed of the evaluation noise (fixed across the run).")

    def __post_init__(self):  # before any training: the end's scores need every one of these
        check(self.every >= 0, "eval.every must be ≥ 0 (0 = only at the end)")
        check(self.prompts >= 1 and self.n >= 1, "eval.prompts and eval.n must be ≥ 1")
        check(self.num_steps >= 1, "eval.num_steps must be ≥ 1 (0 would score the initial noise)")
        check(math.isfinite(self.guidance) and self.guidance >= 1, "eval.guidance must be a finite number ≥ 1")


@dataclass
class PretrainLogConfig:
    every: int = opt(50, "Write metrics every N steps.")
    console_every: int = opt(100, "Console line every N steps (0 = never).")
    tensorboard: bool = opt(True, "Write TensorBoard events to <run.dir>/tensorboard.")
    progress_bar: bool = opt(True, "Show a progress bar (only on a terminal).")


@dataclass
class PretrainConfig:
    run: PretrainRunConfig = opt(PretrainRunConfig, "Run identity, output and resume.", factory=True)
    model: PretrainModelConfig = opt(PretrainModelConfig, "The tiny model to create and train.", factory=True)
    data: ShapesDataConfig = opt(ShapesDataConfig, "ShapesWorld prompts.", factory=True)
    vae: VaePhaseConfig = opt(VaePhaseConfig, "Phase 1: the autoencoder.", factory=True)
    flow: FlowPhaseConfig = opt(FlowPhaseConfig, "Phase 2: the transformer, by flow matching.", factory=True)
    eval: PretrainEvalConfig = opt(PretrainEvalConfig, "ShapesWorld scores of samples during and after training.",
                                   factory=True)  # fmt: skip
    log: PretrainLogConfig = opt(PretrainLogConfig, "Metrics.", factory=True)
    save_every: int = opt(500, "Checkpoint every N steps (both phases count; 0 = only at the end).")
    keep_last: int = opt(2, "Checkpoints to keep (0 = all).")

    @property
    def total_steps(self) -> int:
        return self.vae.steps + self.flow.steps


def load_pretrain_config(path: str | None, overrides: list[str] = ()) -> PretrainConfig:
    return load_config(PretrainConfig, path, list(overrides))
