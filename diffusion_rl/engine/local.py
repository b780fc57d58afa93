"""The in-process engine: one PolicyWorker on one device."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tensordict import TensorDict

from diffusion_rl.data.sampler import StepPrompts
from diffusion_rl.engine.worker import PolicyWorker
from diffusion_rl.errors import UserError
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.sampling.window import SdeWindow


class LocalEngine:
    def __init__(self, cfg):
        self.worker = PolicyWorker(cfg)

    @property
    def model(self):
        return self.worker.model

    def generate(
        self, prompts: StepPrompts, step: int, window: SdeWindow | None, rows: Sequence[int] | None = None
    ) -> TensorDict:
        """Rollouts of the step's prompt instances (or of `rows` of them: a chunk; same samples either way)."""
        rows = list(range(len(prompts))) if rows is None else list(rows)
        return self.worker.generate(
            [prompts.prompts[i] for i in rows],
            [prompts.negative_prompts[i] for i in rows],
            rows,
            prompts.group_index[rows].tolist(),
            step,
            window,
        )

    def update(self, batch: TensorDict, step: int) -> dict[str, float]:
        return self.worker.update(batch, step)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.worker.encode_images(images)

    def offline_batch(
        self, prompts: Sequence[str], negative: Sequence[str | None], sample_index: Sequence[int], latents: torch.Tensor
    ) -> TensorDict:
        return self.worker.offline_batch(prompts, negative, sample_index, latents)

    def sample_images(
        self,
        prompts: Sequence[str],
        negative: Sequence[str | None],
        seeds: Sequence[int],
        settings: SamplerSettings,
        use_ema: bool = True,
    ) -> torch.Tensor:
        return self.worker.sample_images(prompts, negative, seeds, settings, use_ema)

    def save(self, directory: Path) -> None:
        self.worker.save(directory)

    def load(self, directory: Path) -> None:
        if (directory / "dcp").is_dir():
            raise UserError(
                f"{directory} was written by engine.kind=ray (sharded, in dcp/): resume it with engine.kind=ray "
                "(any engine.num_workers)"
            )
        self.worker.load(directory)


def make_engine(cfg):
    if cfg.engine.kind == "local":
        return LocalEngine(cfg)
    if cfg.engine.kind == "ray":
        from diffusion_rl.engine.ray import RayEngine  # imports Ray only when asked for

        return RayEngine(cfg)
    raise ValueError(f"unknown engine.kind '{cfg.engine.kind}'")
