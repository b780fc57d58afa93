"""What a worker is built from: `WorkerSpec`, the narrow part of a run's settings a `PolicyWorker` (and each Ray
actor) needs — the model it trains and in what precision, the rollouts' sampler, the optimizer, the algorithm's
inputs, the texts its prompt-embedding cache holds. The trainer makes it from the config and its own prompts
(trainer/setup.py); the engine reads no config section beyond it and no dataset file."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffusion_rl.algorithms.base import AlgorithmInputs
    from diffusion_rl.config.model import ModelConfig
    from diffusion_rl.config.sampling import SamplingConfig
    from diffusion_rl.config.train import TrainConfig
    from diffusion_rl.models.checkpointing import CheckpointPlan


@dataclass(frozen=True)
class WorkerSpec:
    model: ModelConfig  # what is trained (LoRA or full fine-tuning), where it loads from, its dtype and device
    sampling: SamplingConfig  # the training rollouts
    train: TrainConfig  # the optimizer, its schedule and EMA, and the update's sizes
    algorithm: AlgorithmInputs | None  # how it trains (None: a rollout actor, which only samples)
    seed: int  # run.seed: the rollouts' noise and the initial LoRA weights
    texts: tuple[str, ...] = ()  # every text the run encodes, held by the embedding cache
    embedding_cache: Path | None = None  # the cache's folder or *.safetensors file (None: the text encoders run)
    val_size: tuple[int, int] | None = None  # validation's own height × width, checked against the model at start
    val_guidance_low_noise: float | None = None  # validation's low-noise expert's guidance (two-expert models)
    rollout_dtype: str | None = None  # a rollout actor's model dtype (None: model.dtype)
    weight_change: str = "off"  # measure |Δθ| / |θ| of each optimizer step: on, off or auto
    flops: bool = False  # count the FLOPs of the first rollout and update of each shape
    peak_tflops: float | None = None  # the device's peak, when its table does not know it
    # model.gradient_checkpointing=auto: what the worker weighs against its device's free memory (trainer/setup.py)
    checkpoint_plan: CheckpointPlan | None = None

    @property
    def trains(self) -> bool:
        return self.algorithm is not None

    def for_rollout(self) -> WorkerSpec:
        """A rollout actor's: the model in the rollout dtype, no algorithm (LoRA configured as the trainers', so
        that adapter names match)."""
        model = dataclasses.replace(self.model, dtype=self.rollout_dtype or self.model.dtype)
        return dataclasses.replace(self, model=model, algorithm=None, flops=False)
