"""The in-process engine: one PolicyWorker on one device. `make_engine` picks the engine the config asks for.

What every engine offers the trainer (the Ray engine, engine/ray.py, the same over many workers):
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

import torch

from diffusion_rl.algorithms.base import Targets
from diffusion_rl.data.condition_images import ConditionImage
from diffusion_rl.data.sampler import StepPrompts
from diffusion_rl.engine.worker import PolicyWorker
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.sampling.trajectory import Generated, SampleIds
from diffusion_rl.sampling.window import SdeWindow


def sample_ids(prompts: StepPrompts, rows: Sequence[int]) -> SampleIds:
    """The ids of `rows` of a step's batch: their positions (which seed their noise), groups and prompts."""
    rows = [int(i) for i in rows]
    return SampleIds(
        sample_index=torch.tensor(rows, dtype=torch.long),
        group_index=prompts.group_index[rows].clone(),
        prompt=[prompts.prompts[i] for i in rows],
        policy_version=torch.full((len(rows),), prompts.step, dtype=torch.long),  # the sampler stamps its own
        batch_size=[len(rows)],
    )


class LocalEngine:
    def __init__(self, cfg):
        self.worker = PolicyWorker(cfg)

    @property
    def model(self):
        return self.worker.model

    def generate(
        self, prompts: StepPrompts, step: int, window: SdeWindow | None, rows: Sequence[int] | None = None
    ) -> Generated:
        """Rollouts of the step's prompt instances (or of `rows` of them: a chunk; same samples either way)."""
        rows = list(range(len(prompts))) if rows is None else list(rows)
        negative = [prompts.negative_prompts[i] for i in rows]
        images = [prompts.condition_images[i] for i in rows]
        return self.worker.generate([prompts.prompts[i] for i in rows], negative, sample_ids(prompts, rows), step,
                                    window, images)  # fmt: skip

    def keep_offline(self, prompts: StepPrompts, latents: torch.Tensor, step: int) -> None:
        rows = range(len(prompts))
        self.worker.keep_offline(prompts.prompts, prompts.negative_prompts, sample_ids(prompts, rows), latents, step)

    def update(self, targets: Targets, step: int) -> dict[str, float]:
        return self.worker.update(targets, step)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.worker.encode_images(images)

    def sample_images(
        self,
        prompts: Sequence[str],
        negative: Sequence[str | None],
        seeds: Sequence[int],
        settings: SamplerSettings,
        use_ema: bool = True,
        images: Sequence[Sequence[ConditionImage]] | None = None,
    ) -> torch.Tensor:
        return self.worker.sample_images(prompts, negative, seeds, settings, use_ema, images)

    def save(self, directory: Path) -> dict:
        return self.worker.save(directory)

    def load(self, directory: Path, state: dict) -> None:
        self.worker.load(directory, state)

    def health_problem(self) -> str | None:
        return health_problem(self.worker.optimizer.consecutive_skips, self.worker.weights_finite())


def health_problem(consecutive_skips: int, weights_finite: bool) -> str | None:
    """Why a model should not be checkpointed: its last updates were skipped, or its weights are not finite."""
    if not weights_finite:
        return "the trained weights are not finite"
    if consecutive_skips:
        return f"the last {consecutive_skips} update(s) were skipped for a non-finite gradient"
    return None


def make_engine(cfg):
    if cfg.engine.kind == "local":
        return LocalEngine(cfg)
    if cfg.engine.kind == "ray":
        from diffusion_rl.engine.ray import RayEngine  # imports Ray only when asked for

        return RayEngine(cfg)
    raise ValueError(f"unknown engine.kind '{cfg.engine.kind}'")
