"""The sampler loop: ODE steps outside the SDE window, SDE steps inside it, recording what training needs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from diffusion_rl.models.base import FlowModel
from diffusion_rl.sampling.sde import get_step
from diffusion_rl.sampling.window import SdeWindow, step_types
from diffusion_rl.utils.seeding import make_generator


@dataclass(frozen=True)
class SamplerSettings:
    num_steps: int
    guidance: float
    height: int
    width: int
    sde_type: str = "sde"
    noise_level: float = 0.7


def initial_noise(model: FlowModel, settings: SamplerSettings, seeds: Sequence[int]) -> torch.Tensor:
    """x_1 for each sample from its own seed: a sample's noise never depends on the batch it is in."""
    shape = model.latent_shape(settings.height, settings.width)
    noise = torch.stack([torch.randn(shape, generator=make_generator(s)) for s in seeds])
    return noise.to(model.device)


@torch.no_grad()
def rollout(
    model: FlowModel,
    cond: TensorDict,
    settings: SamplerSettings,
    window: SdeWindow | None,
    *,
    init_seeds: Sequence[int],
    noise_seeds: Sequence[int],
) -> TensorDict:
    """Sample a batch and return its trajectory (a TensorDict, batch [B]).

    Keys: `latents` [B, W+1, …] (x before each window step and after the last one), `log_probs` [B, W],
    `means` [B, W, …], `sigmas`/`sigmas_next`/`stds` [B, W], `step_index` [B, W] (position in the schedule),
    `final_latents` [B, …], `images` uint8 [B, H, W, 3]. W = 0 when `window` is None (pure ODE sampling).
    """
    batch = len(init_seeds)
    if len(noise_seeds) != batch or cond.batch_size[0] != batch:
        raise ValueError(f"rollout: {batch} init seeds, {len(noise_seeds)} noise seeds, {cond.batch_size[0]} conds")
    sigmas = model.sigma_schedule(settings.num_steps, settings.height, settings.width)
    kinds = step_types(settings.num_steps, window, settings.sde_type)
    generators = [make_generator(s) for s in noise_seeds]
    x = initial_noise(model, settings, init_seeds)
    latents, log_probs, means, stds, index = [], [], [], [], []
    with model.eval_mode():
        for j, kind in enumerate(kinds):
            v = model.velocity(x, sigmas[j].item(), cond, settings.guidance)
            out = get_step(kind)(
                x,
                v,
                sigmas[j].item(),
                sigmas[j + 1].item(),
                settings.noise_level,
                generator=generators if kind != "ode" else None,
            )
            if kind != "ode":
                latents.append(x)
                log_probs.append(out.log_prob)
                means.append(out.mean)
                stds.append(out.std)
                index.append(j)
                if j + 1 == window.start + window.size:
                    latents.append(out.prev_sample)
            x = out.prev_sample
    traj = TensorDict(
        {"final_latents": x.float(), "images": model.decode(x).to(x.device)}, batch_size=[batch], device=x.device
    )
    if window is not None:
        step_index = torch.tensor(index, device=x.device)
        traj.update(
            {
                "latents": torch.stack(latents, dim=1),
                "log_probs": torch.stack(log_probs, dim=1),
                "means": torch.stack(means, dim=1),
                "stds": torch.stack(stds, dim=1),
                "sigmas": sigmas[step_index].to(x.device).expand(batch, -1).clone(),
                "sigmas_next": sigmas[step_index + 1].to(x.device).expand(batch, -1).clone(),
                "step_index": step_index.expand(batch, -1).clone(),
            }
        )
    return traj


def recompute_step(model: FlowModel, traj: TensorDict, cond: TensorDict, j: int, settings: SamplerSettings):
    """Log-prob and mean of window step j of a stored trajectory under the active policy (with grad if enabled)."""
    x = traj["latents"][:, j]
    v = model.velocity(x, traj["sigmas"][:, j], cond, settings.guidance)
    step = get_step(settings.sde_type)
    return step(
        x,
        v,
        traj["sigmas"][:, j],
        traj["sigmas_next"][:, j],
        settings.noise_level,
        prev_sample=traj["latents"][:, j + 1],
    )
