"""The sampler loop: ODE steps outside the SDE window, SDE steps inside it, recording what training needs.

`rollout` samples one batch and returns its `Trajectory`; `training_rollout` is a training step's rows, seeded by
their place in the step (what every worker that samples for training calls); `sample_images` is what every other
caller uses
(validation, `sample`, `eval`, `doctor`, `prepare pairs`, pretraining checks): encode the prompts and roll out in
chunks, each sample from its own seeds, so an image never depends on the chunk it was drawn in.
`recompute_step` replays one recorded step under the current weights (the policy-gradient update).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from diffusion_rl.sampling.ode import ODE_SOLVERS, OdeSolver
from diffusion_rl.sampling.sde import StepOutput, get_step
from diffusion_rl.sampling.storage import rounded, storage_dtype, stored_step
from diffusion_rl.sampling.trajectory import SampleIds, Trajectory
from diffusion_rl.sampling.tree import TreeSpec, tree_rollout
from diffusion_rl.sampling.window import SdeWindow, step_types
from diffusion_rl.utils.seeding import make_generator, seed_for

if TYPE_CHECKING:
    from diffusion_rl.models.base import ConditionImages, FlowModel


@dataclass(frozen=True)
class SamplerSettings:
    num_steps: int
    guidance: float
    height: int
    width: int
    sde_type: str = "sde"
    noise_level: float = 0.7
    frames: int = 1  # video frames per sample (a video family); 1 for images
    ode_solver: str = "euler"  # how the steps outside the SDE window integrate the ODE (sampling/ode.py)
    tree: TreeSpec | None = None  # training rollouts sampled as trees (sampling/tree.py); None: flat
    latents_dtype: str = "fp32"  # how the window's latents and means are stored (sampling/storage.py)

    def __post_init__(self):
        if self.ode_solver not in ODE_SOLVERS:
            raise ValueError(f"unknown ODE solver '{self.ode_solver}'; known: {', '.join(ODE_SOLVERS)}")
        storage_dtype(self.latents_dtype)

    @property
    def storage(self) -> torch.dtype:
        """The dtype of the stored window latents and means."""
        return storage_dtype(self.latents_dtype)

    @classmethod
    def of(cls, sampling) -> SamplerSettings:
        """The training rollouts' settings, from the config's `sampling` section."""
        s = sampling
        return cls(s.num_steps, s.guidance, s.height, s.width, s.sde_type, s.noise_level, s.num_frames,
                   s.ode_solver, TreeSpec.of(s.tree), s.latents_dtype)  # fmt: skip


def initial_noise(model: FlowModel, settings: SamplerSettings, seeds: Sequence[int]) -> torch.Tensor:
    """x_1 for each sample from its own seed: a sample's noise never depends on the batch it is in."""
    shape = model.latent_shape(settings.height, settings.width, settings.frames)
    noise = torch.stack([torch.randn(shape, generator=make_generator(s)) for s in seeds])
    return noise.to(model.device)


def anonymous_ids(prompts: Sequence[str]) -> SampleIds:
    """Row ids for a batch that is not part of a training step (validation, evaluation): rows 0..B−1, one group each."""
    rows = torch.arange(len(prompts))
    return SampleIds(sample_index=rows, group_index=rows.clone(), prompt=list(prompts),
                     policy_version=torch.zeros_like(rows), batch_size=[len(prompts)])  # fmt: skip


@torch.no_grad()
def rollout(
    model: FlowModel,
    cond: TensorDict,
    settings: SamplerSettings,
    window: SdeWindow | None,
    *,
    init_seeds: Sequence[int],
    noise_seeds: Sequence[int],
    ids: SampleIds,
) -> Trajectory:
    """Sample a batch of B = len(init_seeds) rows and return its trajectory (W = 0 when `window` is None)."""
    batch = len(init_seeds)
    if len(noise_seeds) != batch or cond.batch_size[0] != batch or ids.batch_size[0] != batch:
        raise ValueError(
            f"rollout: {batch} init seeds, {len(noise_seeds)} noise seeds, {cond.batch_size[0]} conds, "
            f"{ids.batch_size[0]} ids"
        )
    sigmas = model.sigma_schedule(settings.num_steps, settings.height, settings.width, settings.frames)
    kinds = step_types(settings.num_steps, window, settings.sde_type)
    generators = [make_generator(s) for s in noise_seeds]
    solver = OdeSolver(settings.ode_solver)
    x = initial_noise(model, settings, init_seeds)
    latents, log_probs, means, stds, index = [], [], [], [], []
    dtype = settings.storage
    with model.eval_mode():
        for j, kind in enumerate(kinds):
            if kind != "ode":
                x = rounded(x, dtype)  # the velocity sees what is stored, so the update replays it exactly
            v = model.velocity(x, sigmas[j].item(), cond, settings.guidance)
            if kind == "ode":
                x = solver.step(x, v, sigmas[j].item(), sigmas[j + 1].item())
                continue
            out = stored_step(kind, x, v, sigmas[j].item(), sigmas[j + 1].item(), settings.noise_level, generators,
                              dtype)  # fmt: skip
            latents.append(x.to(dtype))
            log_probs.append(out.log_prob)
            means.append(out.mean.to(dtype))
            stds.append(out.std)
            index.append(j)
            if j + 1 == window.start + window.size:
                latents.append(out.prev_sample.to(dtype))
            solver.reset()  # the history is from before the noise this step added: restart at first order
            x = out.prev_sample
    device = x.device
    steps = {}
    if window is not None:
        step_index = torch.tensor(index, device=device)
        steps = {
            "latents": torch.stack(latents, dim=1),
            "log_probs": torch.stack(log_probs, dim=1),
            "means": torch.stack(means, dim=1),
            "stds": torch.stack(stds, dim=1),
            "sigmas": sigmas[step_index].to(device).expand(batch, -1).clone(),
            "sigmas_next": sigmas[step_index + 1].to(device).expand(batch, -1).clone(),
            "step_index": step_index.expand(batch, -1).clone(),
        }
    return Trajectory(
        final_latents=x.float(),
        cond=cond,
        ids=ids.to(device),
        images=model.decode(x).to(device),
        nfe=torch.full((batch,), float(len(kinds) * model.forwards_per_evaluation(settings.guidance)), device=device),
        **steps,
        batch_size=[batch],
        device=device,
    )


@torch.no_grad()
def training_rollout(
    model: FlowModel,
    settings: SamplerSettings,
    prompts: Sequence[str],
    negative: Sequence[str | None],
    ids: SampleIds,
    step: int,
    window: SdeWindow | None,
    images: ConditionImages | None = None,
    *,
    seed: int,
    share_initial_noise: bool,
) -> Trajectory:
    """Rows of training step `step` (run.seed `seed`): row i's noise comes from (seed, step, ids.sample_index[i]),
    its initial noise from its group's index instead with share_initial_noise, so a row is the same sample whichever
    worker draws it, in whichever chunk. Samples with the model's active policy; `images`: each row's condition
    images, fitted to the output size (editing families). With `settings.tree` the rows are sampled as trees
    (sampling/tree.py: whole groups, seeded by group and node instead)."""
    cond = model.encode_prompts(list(prompts), [n or "" for n in negative], images)
    if settings.tree is not None:
        return tree_rollout(model, cond, settings, window, settings.tree, ids, seed=seed, step=step)
    init_ids = ids.group_index if share_initial_noise else ids.sample_index
    return rollout(
        model,
        cond,
        settings,
        window,
        init_seeds=[seed_for(seed, step, "init_noise", int(i)) for i in init_ids],
        noise_seeds=[seed_for(seed, step, "sde_noise", int(i)) for i in ids.sample_index],
        ids=ids,
    )


@torch.no_grad()
def sample_images(
    model: FlowModel,
    prompts: Sequence[str],
    negative: Sequence[str | None],
    settings: SamplerSettings,
    *,
    init_seeds: Sequence[int],
    noise_seeds: Sequence[int] | None = None,
    window: SdeWindow | None = None,
    batch_size: int | None = None,
    images: ConditionImages | None = None,
) -> torch.Tensor:
    """uint8 [N, H, W, 3] (a video family: [N, F, H, W, 3]) on the CPU: sample i from (init_seeds[i],
    noise_seeds[i]) (noise seeds default to the init seeds) with prompt i and its condition images `images[i]`
    (editing families), in chunks of `batch_size` rows (None: all at once), each chunk encoding its own prompts.
    ODE sampling unless a `window` makes steps stochastic."""
    noise_seeds = list(init_seeds) if noise_seeds is None else list(noise_seeds)
    if not (len(prompts) == len(negative) == len(init_seeds) == len(noise_seeds)) or (
        images is not None and len(images) != len(prompts)
    ):
        raise ValueError(
            f"sample_images: {len(prompts)} prompts, {len(negative)} negatives, {len(init_seeds)} init seeds, "
            f"{len(noise_seeds)} noise seeds, {'no' if images is None else len(images)} condition image rows"
        )
    size = batch_size or max(1, len(prompts))
    outputs = []
    for start in range(0, len(prompts), size):
        rows = slice(start, start + size)
        chunk = list(prompts[rows])
        chunk_images = None if images is None else list(images[rows])
        cond = model.encode_prompts(chunk, [n or "" for n in negative[rows]], chunk_images)
        traj = rollout(
            model,
            cond,
            settings,
            window,
            init_seeds=list(init_seeds[rows]),
            noise_seeds=noise_seeds[rows],
            ids=anonymous_ids(chunk),
        )
        outputs.append(traj.images.cpu())
    if not outputs:
        frames = (settings.frames,) if model.video else ()
        return torch.zeros(0, *frames, settings.height, settings.width, 3, dtype=torch.uint8)
    return torch.cat(outputs)


def recompute_step(
    model: FlowModel,
    x: torch.Tensor,
    x_next: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    cond: TensorDict,
    settings: SamplerSettings,
) -> StepOutput:
    """Log-prob and mean of the recorded step x [B, …] → x_next at σ → σ_next ([B] each) under the active policy,
    with the rollout's guidance and step type (with grad if enabled). x and x_next may be stored in a half type
    (`sampling.latents_dtype`): they are read as fp32."""
    x, x_next = x.float(), x_next.float()
    v = model.velocity(x, sigma, cond, settings.guidance)
    return get_step(settings.sde_type)(x, v, sigma, sigma_next, settings.noise_level, prev_sample=x_next)
