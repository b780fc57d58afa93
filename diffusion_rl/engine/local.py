"""The in-process engine: one PolicyWorker on one device."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tensordict import TensorDict

from diffusion_rl.data.sampler import StepPrompts
from diffusion_rl.engine.worker import PolicyWorker
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.sampling.window import SdeWindow


class LocalEngine:
    def __init__(self, cfg):
        self.worker = PolicyWorker(cfg)

    @property
    def model(self):
        return self.worker.model

    def generate(self, prompts: StepPrompts, step: int, window: SdeWindow | None) -> TensorDict:
        return self.worker.generate(
            prompts.prompts,
            prompts.negative_prompts,
            list(range(len(prompts))),
            prompts.group_index.tolist(),
            step,
            window,
        )

    def update(self, batch: TensorDict, step: int) -> dict[str, float]:
        return self.worker.update(batch, step)

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
        self.worker.load(directory)


def make_engine(cfg):
    if cfg.engine.kind == "local":
        return LocalEngine(cfg)
    raise ValueError(f"unknown engine.kind '{cfg.engine.kind}'")
