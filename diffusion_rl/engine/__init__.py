"""The engine: what the trainer calls to sample, keep and train on a step's rows. One seam, two implementations.

`make_engine(engine, spec)` gives the engine that `engine.kind` names, its workers built from `spec` (engine/spec.py:
the narrow part of the run's settings a worker needs, which the trainer makes):
- local: one `PolicyWorker` (engine/worker.py) on one device: the engine is the worker itself;
- ray: `RayEngine` (engine/ray.py), the same worker on every Ray actor (FSDP2-sharded trainers; with
  engine.rollout=separate also rollout actors, workers that do not train), the driver splitting each call.

What every engine offers the trainer (`Engine`):
- `generate(prompts, step, window, rows)`: roll out rows of the step's prompts (with their condition images), keep
  their trajectories, return a `Generated`: their images (uint8 [n, H, W, 3]; videos [n, F, H, W, 3]; CPU) and which
  rows came out finite; `keep_offline(prompts, latents, step)`: keep offline latents instead;
- `update(targets, step)`: train on the kept trajectories of `step` with the algorithm's targets (same rows);
- `sample_images(...)` (validation), `encode_images(...)`;
- `save(directory) -> state` / `load(directory, state)`: dcp/ in the directory, plain state for the trainer's
  state.pt (checkpoint/state.py); `health_problem()`: why the model should not be checkpointed now, or None.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from diffusion_rl.algorithms.credit import Targets
from diffusion_rl.config.engine import EngineConfig
from diffusion_rl.data.condition_images import ConditionImage
from diffusion_rl.data.sampler import StepPrompts
from diffusion_rl.engine.spec import WorkerSpec
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.sampling.trajectory import Generated
from diffusion_rl.sampling.window import SdeWindow


class Engine(Protocol):
    def generate(
        self, prompts: StepPrompts, step: int, window: SdeWindow | None, rows: Sequence[int] | None = None
    ) -> Generated: ...

    def sampling_chunks(self, rows: int, parts: int) -> list[list[int]]:
        """The step's rows cut into `parts` chunks sampled one after the other (sampling.score_chunks), each spread
        over every worker that samples (utils/split.py: `chunks_of_shares`)."""
        ...

    def keep_offline(self, prompts: StepPrompts, latents: torch.Tensor, step: int) -> None: ...

    def update(self, targets: Targets, step: int) -> dict[str, float]: ...

    def encode_images(self, images: torch.Tensor) -> torch.Tensor: ...

    def sample_images(
        self,
        prompts: Sequence[str],
        negative: Sequence[str | None],
        seeds: Sequence[int],
        settings: SamplerSettings,
        use_ema: bool = True,
        images: Sequence[Sequence[ConditionImage]] | None = None,
    ) -> torch.Tensor: ...

    def save(self, directory: Path) -> dict: ...

    def load(self, directory: Path, state: dict) -> None: ...

    def health_problem(self) -> str | None: ...


def make_engine(engine: EngineConfig, spec: WorkerSpec) -> Engine:
    """The engine `engine.kind` names (Ray is imported only when asked for)."""
    if engine.kind == "local":
        from diffusion_rl.engine.worker import PolicyWorker

        return PolicyWorker(spec)
    if engine.kind == "ray":
        from diffusion_rl.engine.ray import RayEngine

        return RayEngine(engine, spec)
    raise ValueError(f"unknown engine.kind '{engine.kind}'")
