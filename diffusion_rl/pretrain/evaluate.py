"""ShapesWorld scores of a model's ODE samples: how well it follows held-out prompts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from diffusion_rl.data.shapes import SceneSpec
from diffusion_rl.models.base import FlowModel
from diffusion_rl.rewards.shapes import color_score, count_score, geneval_score, position_score, read_images
from diffusion_rl.sampling.rollout import SamplerSettings, sample_images
from diffusion_rl.utils.seeding import seed_for


@torch.no_grad()
def sample_specs(
    model: FlowModel, specs: Sequence[SceneSpec], settings: SamplerSettings, seed: int, batch_size: int = 32
) -> np.ndarray:
    """uint8 [len(specs), H, W, 3]: one ODE sample per spec, sample i from seed (seed, i)."""
    prompts = [s.prompt() for s in specs]
    seeds = [seed_for(seed, "shapes_eval", i) for i in range(len(prompts))]
    return sample_images(model, prompts, [""] * len(prompts), settings, init_seeds=seeds, batch_size=batch_size).numpy()


def score_images(specs: Sequence[SceneSpec], images: np.ndarray) -> dict[str, float]:
    """Mean ShapesWorld scores: `shapes/geneval`, `shapes/color`, `shapes/count`, `shapes/position` (over prompts
    that ask for one) and `shapes/geneval/<kind>` per kind of prompt."""
    readings = read_images(images)
    geneval = np.array([geneval_score(s, r) for s, r in zip(specs, readings)])
    metrics = {
        "shapes/geneval": float(geneval.mean()),
        "shapes/color": float(np.mean([color_score(s, r) for s, r in zip(specs, readings)])),
        "shapes/count": float(np.mean([count_score(s, r) for s, r in zip(specs, readings)])),
    }
    placed = [(s, r) for s, r in zip(specs, readings) if s.position is not None or s.relation is not None]
    if placed:
        metrics["shapes/position"] = float(np.mean([position_score(s, r) for s, r in placed]))
    for kind in sorted({s.kind for s in specs}):
        metrics[f"shapes/geneval/{kind}"] = float(np.mean([g for s, g in zip(specs, geneval) if s.kind == kind]))
    return metrics
