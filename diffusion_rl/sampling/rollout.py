"""The sampler loop: ODE steps outside the SDE window, SDE steps inside it, recording what training needs.

`rollout` samples one batch and returns its `Trajectory`: flat rows, or trees (sampling/tree.py: a group sampled
as one tree whose nodes split at given SDE steps; a flat rollout is a tree with no split), in one loop where the
rounding to the stored dtype, the solver's reset after a stochastic step and the window's end are written once.
`training_rollout` is a training step's rows, seeded by their place in the step (what every worker that samples
for training calls); `sample_images` is what every other caller uses (validation, `sample`, `eval`, `doctor`,
`prepare pairs`, pretraining checks): encode the prompts and roll out in chunks, each sample from its own seeds, so
an image never depends on the chunk it was drawn in.
`recompute_step` replays one recorded step under the current weights (the policy-gradient update).

Storage in a half type (`sampling.latents_dtype`: half the memory of the kept window's `latents` [B, W+1, …] and
`means` [B, W, …]; log-probs, stds and sigmas stay fp32): rounding only what is stored would make the update's
recomputed log-prob differ from the rollout's even on-policy. So inside the SDE window the sample itself is the
rounded one: x_j is rounded before the window step's velocity, the drawn x_{j+1} is rounded, and the recorded
log-prob is that of the rounded x_{j+1} (a second call of the step scores it, drawing no noise). The update then
replays the rollout exactly (ratio 1 on-policy); the samples differ from fp32 storage's by that rounding (a relative
2⁻⁹ for bf16, 2⁻¹² for fp16, far below the step's noise). The stored means are rounded copies of fp32 means:
grpo_guard's drift term and flow_dppo's KL mask read them at the scale of the step noise, where bf16's rounding is
about their thresholds, so those losses refuse bf16 and take fp16 (algorithms/policy_gradient.py:
`require_exact_anchor_means`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from diffusion_rl.config.plugins import STEP_TYPES
from diffusion_rl.models.condition import VAE_ROWS
from diffusion_rl.models.guidance import Guidance
from diffusion_rl.sampling.ode import ODE_SOLVER_NAMES, OdeSolver
from diffusion_rl.sampling.sde import StepOutput, check_sigmas
from diffusion_rl.sampling.trajectory import SampleIds, Trajectory
from diffusion_rl.sampling.tree import TreeNodes, TreeSpec
from diffusion_rl.sampling.window import SdeWindow, step_types
from diffusion_rl.utils.dtypes import DTYPES
from diffusion_rl.utils.seeding import generator_of, seed_for

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
    latents_dtype: str = "fp32"  # how the window's latents and means are stored (module docstring)
    guidance_low_noise: float | None = None  # two timestep experts: the low-noise one's scale (None: `guidance`)

    def __post_init__(self):
        if self.ode_solver not in ODE_SOLVER_NAMES:
            raise ValueError(f"unknown ODE solver '{self.ode_solver}'; known: {', '.join(ODE_SOLVER_NAMES)}")
        if self.latents_dtype not in DTYPES:
            raise ValueError(f"unknown latents dtype '{self.latents_dtype}'; known: {', '.join(DTYPES)}")

    @classmethod
    def of(cls, sampling) -> SamplerSettings:
        """The training rollouts' settings, from the config's `sampling` section."""
        s = sampling
        return cls(s.num_steps, s.guidance, s.height, s.width, s.sde_type, s.noise_level, s.num_frames,
                   s.ode_solver, TreeSpec.of(s.tree), s.latents_dtype, s.guidance_low_noise)  # fmt: skip

    @property
    def scales(self) -> Guidance:
        """The guidance the model's velocity takes: `guidance` carrying the low-noise expert's (models/guidance.py)."""
        return Guidance(self.guidance, self.guidance_low_noise)


def initial_noise(model: FlowModel, settings: SamplerSettings, seeds: Sequence[int | tuple]) -> torch.Tensor:
    """x_1 for each root from its own seed: a sample's noise never depends on the batch it is in."""
    shape = model.latent_shape(settings.height, settings.width, settings.frames)
    noise = torch.stack([torch.randn(shape, generator=generator_of(s)) for s in seeds])
    return noise.to(model.device)


def anonymous_ids(prompts: Sequence[str]) -> SampleIds:
    """Row ids for a batch that is not part of a training step (validation, evaluation): rows 0..B−1, one group each."""
    rows = torch.arange(len(prompts))
    return SampleIds(sample_index=rows, group_index=rows.clone(), prompt=list(prompts),
                     policy_version=torch.zeros_like(rows), batch_size=[len(prompts)])  # fmt: skip


@torch.no_grad()
def rollout(model: FlowModel, cond: TensorDict, settings: SamplerSettings, window: SdeWindow | None, *,
            init_seeds: Sequence[int | tuple], noise_seeds: Sequence[int | tuple], ids: SampleIds,
            tree: TreeSpec | None = None) -> Trajectory:  # fmt: skip
    """Sample B rows and return their trajectory (W = 0 when `window` is None), in the order of `ids`.

    The rows grow from R roots: each row its own (flat, `tree` None: R = B), or one per group (a tree of N =
    tree.leaves rows, sampling/tree.py, whose split steps share a node's x and velocity among its children). Root r
    starts from `init_seeds[r]`'s noise and draws its SDE noise from `noise_seeds[r]` (a tree's node: from those seed
    parts followed by its depth and index). A seed is an int or a tuple of seed parts (utils/seeding.py)."""
    B, N = ids.batch_size[0], 1 if tree is None else tree.leaves
    R = B // N
    nodes = None if tree is None else TreeNodes(tree, ids, cond, noise_seeds, settings.num_steps, window)
    if len(init_seeds) != R or len(noise_seeds) != R or cond.batch_size[0] != B:
        raise ValueError(f"rollout: {B} rows ({R} roots), {len(init_seeds)} init seeds, {len(noise_seeds)} noise "
                         f"seeds, {cond.batch_size[0]} conds")  # fmt: skip
    sigmas = model.sigma_schedule(settings.num_steps, settings.height, settings.width, settings.frames)
    check_sigmas(sigmas, settings.sde_type)  # once here: the steps, and the update's recomputed ones, check none
    sigma_at = sigmas.tolist()  # the loop reads floats: no tensor is read back per step (docs/architecture.md)
    kinds = step_types(settings.num_steps, window, settings.sde_type)
    x = initial_noise(model, settings, init_seeds)
    generators = [generator_of(s) for s in noise_seeds] if nodes is None else None  # a tree's: its nodes'
    history: dict[str, list[torch.Tensor]] = {"latents": [], "log_probs": [], "means": [], "stds": []}
    index, evaluations = [j for j, kind in enumerate(kinds) if kind != "ode"], 0  # the window's steps
    solver = OdeSolver(settings.ode_solver)
    dtype = DTYPES[settings.latents_dtype]  # of the stored window latents and means
    with model.eval_mode():
        for j, kind in enumerate(kinds):
            if kind != "ode":  # the velocity sees what is stored, so the update replays it exactly (fp32: x itself)
                x = x.to(dtype).float()
            v = model.velocity(x, sigma_at[j], cond if nodes is None else nodes.cond, settings.scales)
            evaluations += x.shape[0]
            if nodes is not None and j in tree.branch_at:  # the children share x_j and its velocity
                x, v, history = nodes.split(x, v, history)
            if kind == "ode":  # splits are SDE steps, so the node count is fixed across the solver's history
                x = solver.step(x, v, sigma_at[j], sigma_at[j + 1])
                continue
            step = STEP_TYPES.get(kind)
            out = step(x, v, sigma_at[j], sigma_at[j + 1], settings.noise_level,
                       generator=generators if nodes is None else nodes.generators)  # fmt: skip
            if dtype != torch.float32:  # the drawn sample as stored, scored under the same Gaussian (no new noise)
                out = step(x, v, sigma_at[j], sigma_at[j + 1], settings.noise_level,
                           prev_sample=out.prev_sample.to(dtype).float())  # fmt: skip
            for key, value in zip(history, (x.to(dtype), out.log_prob, out.mean.to(dtype), out.std)):
                history[key].append(value)
            if j + 1 == window.start + window.size:  # the window's end: x after its last step
                history["latents"].append(out.prev_sample.to(dtype))
            solver.reset()  # the history is from before the noise this step added: restart at first order
            x = out.prev_sample

    def in_order(t: torch.Tensor) -> torch.Tensor:  # a tree's sorted leaves back in the caller's order
        return t if nodes is None else nodes.in_order(t)

    x = model.finished_latents(in_order(x), cond)  # after the window's latents were kept: the update replays those
    device = x.device
    steps = {}
    if window is not None:
        step_index = torch.tensor(index)  # on the CPU, where the schedule `sigmas` lives
        steps = {key: in_order(torch.stack(ts, dim=1)) for key, ts in history.items()}
        per_step = {"sigmas": sigmas[step_index], "sigmas_next": sigmas[step_index + 1], "step_index": step_index}
        steps.update({key: t.to(device).expand(B, -1).clone() for key, t in per_step.items()})  # a copy per row
    # transformer forwards per image: a tree's shared nodes split among their leaves
    forwards = evaluations * model.forwards_per_evaluation(settings.scales) / N / R
    images, nfe = decode_in_chunks(model, x).to(device), torch.full((B,), float(forwards), device=device)
    return Trajectory(final_latents=x.float(), cond=cond, ids=ids.to(device), images=images, nfe=nfe, **steps,
                      batch_size=[B], device=device)  # fmt: skip


def decode_in_chunks(model: FlowModel, latents: torch.Tensor) -> torch.Tensor:
    """model.decode of `latents` [B, …], VAE_ROWS rows at a time (a Ray worker's 144 rows at once would hold
    ~54 GiB of the VAE's intermediates at 512 px; `diffusion-rl estimate` counts one chunk's)."""
    return torch.cat([model.decode(rows) for rows in latents.split(VAE_ROWS)])


@torch.no_grad()
def training_rollout(model: FlowModel, settings: SamplerSettings, prompts: Sequence[str],
                     negative: Sequence[str | None], ids: SampleIds, step: int, window: SdeWindow | None,
                     images: ConditionImages | None = None, *, seed: int,
                     share_initial_noise: bool) -> Trajectory:  # fmt: skip
    """Rows of training step `step` (run.seed `seed`), each the same sample whichever worker draws it, in whichever
    chunk. Flat: row i's noise from (seed, step, ids.sample_index[i]), its initial noise from its group's index with
    share_initial_noise. A tree (`settings.tree`): group g's root noise from (seed, step, "tree_init", g), its nodes'
    SDE noise from (seed, step, "tree_sde", g, …). `images`: each row's condition images (editing families)."""
    cond = model.encode_prompts(list(prompts), [n or "" for n in negative], images)
    if settings.tree is not None:  # one root per group (sampling/tree.py)
        init, noise = settings.tree.seeds(seed, step, ids.group_index)
    else:
        init_ids = ids.group_index if share_initial_noise else ids.sample_index
        init = [seed_for(seed, step, "init_noise", int(i)) for i in init_ids]
        noise = [seed_for(seed, step, "sde_noise", int(i)) for i in ids.sample_index]
    return rollout(model, cond, settings, window, init_seeds=init, noise_seeds=noise, ids=ids, tree=settings.tree)


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


def recompute_step(model: FlowModel, x: torch.Tensor, x_next: torch.Tensor, sigma: torch.Tensor,
                   sigma_next: torch.Tensor, cond: TensorDict, settings: SamplerSettings) -> StepOutput:  # fmt: skip
    """Log-prob and mean of the recorded step x [B, …] → x_next at σ → σ_next ([B] each) under the active policy,
    with the rollout's guidance and step type (with grad if enabled); x and x_next are read as fp32."""
    x, x_next = x.float(), x_next.float()
    v = model.velocity(x, sigma, cond, settings.scales)
    return STEP_TYPES.get(settings.sde_type)(x, v, sigma, sigma_next, settings.noise_level, prev_sample=x_next)
