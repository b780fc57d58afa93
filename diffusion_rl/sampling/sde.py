"""One sampler step of a flow-matching model, deterministic or stochastic, with the log-probability of its result.

The model predicts a velocity v at noise level sigma (x_sigma = (1 - sigma)·x0 + sigma·noise, so v ≈ noise - x0);
a step moves x from `sigma` down to `sigma_next`. RL on such a model needs steps that draw noise and report the
Gaussian log-density of what they drew. Step types, registered by name in `STEP_TYPES` (config/plugins.py):

- `ode`: the plain Euler step of the flow ODE. No noise, log-prob 0.
- `sde`: the reverse-time SDE with the same marginals as the ODE, discretised with Euler–Maruyama, as in
  Flow-GRPO. Its noise scale blows up as sigma → 1 and its log-prob has the usual Gaussian normaliser.
- `sde_linear`: flow_grpo's Wan step: the `sde` step's mean with std_dev_t = noise_level·sigma, linear in sigma
  (flow_grpo's σ_min + (σ_max − σ_min)·σ with σ_min = 0 and σ_max = noise_level), finite at sigma = 1.
- `cps`: the coefficients-preserving step (as implemented in flow_grpo and verl-omni). It rebuilds x_next from the
  predicted clean image and predicted noise so that the clean/noise coefficients match the schedule exactly, and
  adds fresh noise in place of part of the predicted noise. Its log-prob is the bare squared error, with no
  variance or constant terms.
- `dance_sde`: DanceGRPO's step: an Euler step plus a score correction, with noise std eta·sqrt(sigma - sigma_next).

Every step function has the signature of `StepFn` and returns a `StepOutput`; callers look one up with
`STEP_TYPES.get(name)`, whose error lists the valid names. The math runs in fp32 whatever the
input dtype. `std` in the output is the step's std_dev_t as each method defines it; the noise actually added has
std `std·sqrt(sigma - sigma_next)` for `sde` and `std` for the others (`sde_linear` reports its noise std, so that
the KL to the reference is the true Gaussian KL, as flow_grpo's Wan script computes it).

A row whose std is 0 (noise_level 0, or `cps` with sigma_next 0) is deterministic: its prev_sample is the mean
(unless one is given) and its log_prob is 0, as for `ode`. Noise is still drawn for such rows, so a generator
advances the same way whatever the noise level.
"""

import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from diffusion_rl.config.plugins import STEP_TYPES

Generators = torch.Generator | Sequence[torch.Generator] | None

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class StepOutput(NamedTuple):
    prev_sample: Tensor  # [B, ...] fp32: x at sigma_next (drawn, or the given prev_sample)
    log_prob: Tensor  # [B] fp32: mean over non-batch dims of the elementwise log-density of prev_sample
    mean: Tensor  # [B, ...] fp32: mean of the step's Gaussian
    std: Tensor  # [B] fp32: the step's std_dev_t (see the module docstring for how it scales the noise)


class StepFn(Protocol):
    def __call__(
        self,
        x: Tensor,
        v: Tensor,
        sigma: float | Tensor,
        sigma_next: float | Tensor,
        noise_level: float,
        *,
        prev_sample: Tensor | None = None,
        generator: Generators = None,
    ) -> StepOutput: ...


# ---------------------------------------------------------------------------------------------------------------
# Shared plumbing: validation, broadcasting, noise, log-densities


class _Inputs(NamedTuple):
    x: Tensor  # [B, ...] fp32
    v: Tensor  # [B, ...] fp32
    sigma_B: Tensor  # [B] fp32
    sigma_next_B: Tensor  # [B] fp32
    prev_sample: Tensor | None  # [B, ...] fp32


def _per_row(value: float | Tensor, x: Tensor, name: str) -> Tensor:
    if not isinstance(value, Tensor):  # filled on x's device: a tensor made from the float would be a copy that waits
        return torch.full(x.shape[:1], value, dtype=torch.float32, device=x.device)
    value_B = value.to(x.device, torch.float32)
    if value_B.ndim == 0:
        return value_B.expand(x.shape[0])
    if value_B.shape != x.shape[:1]:
        raise ValueError(f"{name} must be a float or a tensor of shape [B]=[{x.shape[0]}], got {tuple(value_B.shape)}")
    return value_B


def check_sigmas(sigmas: Sequence[float] | Tensor, sde_type: str) -> None:
    """A sampler's schedule, checked once where it is made (its steps then run without a host synchronisation):
    strictly decreasing, ≥ 0, and for the `sde` step ≤ 1 (its std has 1 − σ under a root)."""
    values = [float(s) for s in sigmas]
    for i, (sigma, sigma_next) in enumerate(zip(values, values[1:])):
        if not sigma_next < sigma:
            raise ValueError("sampling runs from noise to data, so sigma_next must be < sigma; got "
                             f"sigma={sigma:g}, sigma_next={sigma_next:g} (step {i})")  # fmt: skip
    if values and min(values) < 0:
        raise ValueError(f"sigma_next must be >= 0, got {min(values):g}")
    if sde_type == "sde" and values and max(values) > 1:
        raise ValueError(f"the sde step needs sigma <= 1 (its std has 1 - sigma under a root), got {max(values):g}")


def sde_linear_advice(sde_type: str, noise_level: float, sigmas: Sequence[float] | Tensor) -> str | None:
    """One line when `sde_linear`'s noise_level is not its schedule's σ_max = sigmas[1], the value flow_grpo's Wan
    step uses (the shift in a checkpoint's scheduler config and the step count move it); None otherwise."""
    if sde_type != "sde_linear" or len(sigmas) < 2:
        return None
    sigma_max = float(sigmas[1])
    if abs(noise_level - sigma_max) <= 5e-4:
        return None
    return (
        f"sampling.noise_level={noise_level:g} with sde_type=sde_linear: flow_grpo's Wan step scales its noise by "
        f"this schedule's sigma_max = sigmas[1] = {sigma_max:.4f}; set sampling.noise_level={sigma_max:.4f} to "
        "match it (a different level is a choice of yours)"
    )


def _prepare(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor,
             prev_sample: Tensor | None) -> _Inputs:  # fmt: skip
    """The inputs: tensors in fp32, sigma and sigma_next per row [B]. Only their shapes are checked here (every step
    of every rollout and update runs this): the schedule is checked where it is made (`check_sigmas`, in the
    rollout; the update replays its steps), the noise level when the config loads."""
    if x.ndim < 2:
        raise ValueError(f"x must have shape [B, ...] with at least one non-batch dim, got shape {tuple(x.shape)}")
    for name, t in (("v", v), ("prev_sample", prev_sample)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name} must have the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")
    sigma_B, sigma_next_B = _per_row(sigma, x, "sigma"), _per_row(sigma_next, x, "sigma_next")
    return _Inputs(x.float(), v.float(), sigma_B, sigma_next_B, None if prev_sample is None else prev_sample.float())


def _rows(value_B: Tensor, like: Tensor) -> Tensor:
    """[B] → [B, 1, ..., 1] so it broadcasts against `like` ([B, ...])."""
    return value_B.view(-1, *([1] * (like.ndim - 1)))


def _row_mean(value: Tensor) -> Tensor:
    """[B, ...] → [B]: mean over all non-batch dims."""
    return value.mean(dim=tuple(range(1, value.ndim)))


def _noise(like: Tensor, generator: Generators) -> Tensor:
    """Standard normal noise of like's shape, fp32 on like's device: one generator draws the batch at once, a list
    row i with generator[i] (so a sample's noise does not depend on the batch); each on its own device."""
    shape = like.shape
    if generator is None:
        return torch.randn(shape, dtype=torch.float32, device=like.device)
    if isinstance(generator, torch.Generator):
        return _to(torch.randn(shape, generator=generator, dtype=torch.float32, device=generator.device), like.device)
    if len(generator) != shape[0]:
        raise ValueError(f"a list of generators needs one per row: got {len(generator)} for a batch of {shape[0]}")
    rows = [torch.randn(shape[1:], generator=g, dtype=torch.float32, device=g.device) for g in generator]
    return _to(torch.stack(rows), like.device)


def _to(noise: Tensor, device: torch.device) -> Tensor:
    """Noise drawn by host generators, on `device`: to a GPU from pinned memory without waiting (a copy from pageable
    memory makes the host wait for the stream, once per step); the values are the same either way."""
    if noise.device.type == "cpu" and device.type == "cuda":
        return noise.pin_memory().to(device, non_blocking=True)
    return noise.to(device)


def _sample(mean: Tensor, noise_std_B: Tensor, prev_sample: Tensor | None, generator: Generators) -> Tensor:
    return prev_sample if prev_sample is not None else mean + _rows(noise_std_B, mean) * _noise(mean, generator)


def _gaussian_log_prob(sample: Tensor, mean: Tensor, noise_std_B: Tensor) -> Tensor:
    """[B]: mean over non-batch dims of log N(sample; mean, noise_std²); 0 for rows whose std is 0."""
    random_B = noise_std_B > 0
    # The std-0 rows get a stand-in std of 1 so that neither the value nor its gradient turns into NaN there.
    safe_std = _rows(torch.where(random_B, noise_std_B, torch.ones_like(noise_std_B)), mean)
    # The sample is an action taken: gradients flow through the mean only.
    log_density = -((sample.detach() - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    return torch.where(random_B, _row_mean(log_density), torch.zeros_like(noise_std_B))


def _euler_maruyama_mean(inp: _Inputs, std_dev_t_B: Tensor) -> Tensor:
    """[B, ...]: Flow-GRPO's Euler–Maruyama mean for the diffusion coefficient std_dev_t [B]. The drift
    v - (std²/2)·∇log p keeps the ODE's marginals; for the linear path ∇log p = -(x + (1-s)·v)/s."""
    std, s = _rows(std_dev_t_B, inp.x), _rows(inp.sigma_B, inp.x)  # [B, 1, ...]
    dt = _rows(inp.sigma_next_B, inp.x) - s
    return inp.x * (1 + std**2 / (2 * s) * dt) + inp.v * (1 + std**2 * (1 - s) / (2 * s)) * dt


# ---------------------------------------------------------------------------------------------------------------
# Step types


@STEP_TYPES.register("ode")
def ode_step(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, noise_level: float, *,
             prev_sample: Tensor | None = None, generator: Generators = None) -> StepOutput:  # fmt: skip
    """Euler step of the flow ODE: x + v·dt. Ignores noise_level and generator; log_prob is 0."""
    inp = _prepare(x, v, sigma, sigma_next, prev_sample)
    dt = _rows(inp.sigma_next_B - inp.sigma_B, inp.x)
    mean = inp.x + inp.v * dt
    zeros_B = torch.zeros_like(inp.sigma_B)
    return StepOutput(mean if inp.prev_sample is None else inp.prev_sample, zeros_B, mean, zeros_B)


@STEP_TYPES.register("sde")
def sde_step(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, noise_level: float, *,
             prev_sample: Tensor | None = None, generator: Generators = None) -> StepOutput:  # fmt: skip
    """Flow-GRPO's Euler–Maruyama step. std = noise_level·sqrt(sigma / (1 - sigma)); noise std std·sqrt(-dt)."""
    inp = _prepare(x, v, sigma, sigma_next, prev_sample)
    # sigma / (1 - sigma) is infinite at sigma = 1 (pure noise, the first step); the reference uses the next
    # sigma in the denominator there, which keeps the first step's std finite (though large).
    sigma_tilde_B = torch.where(inp.sigma_B == 1, inp.sigma_next_B, inp.sigma_B)
    std_B = noise_level * torch.sqrt(inp.sigma_B / (1 - sigma_tilde_B))
    mean = _euler_maruyama_mean(inp, std_B)
    noise_std_B = std_B * torch.sqrt(inp.sigma_B - inp.sigma_next_B)  # std·sqrt(-dt): Brownian increment over |dt|
    sample = _sample(mean, noise_std_B, inp.prev_sample, generator)
    return StepOutput(sample, _gaussian_log_prob(sample, mean, noise_std_B), mean, std_B)


@STEP_TYPES.register("sde_linear")
def sde_linear_step(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, noise_level: float, *,
                    prev_sample: Tensor | None = None, generator: Generators = None) -> StepOutput:  # fmt: skip
    """flow_grpo's Wan step: the `sde` step's mean with std_dev_t = noise_level·sigma, noise std
    std_dev_t·sqrt(sigma - sigma_next), which is also the std it reports."""
    inp = _prepare(x, v, sigma, sigma_next, prev_sample)
    # flow_grpo's std_dev_t = σ_min + (σ_max − σ_min)·σ with σ_max = sigmas[1] and σ_min = sigmas[-1], which is 0 on
    # every schedule that ends at the data: noise_level plays σ_max. Finite at σ = 1, unlike `sde`'s.
    std_dev_t_B = noise_level * inp.sigma_B
    mean = _euler_maruyama_mean(inp, std_dev_t_B)
    noise_std_B = std_dev_t_B * torch.sqrt(inp.sigma_B - inp.sigma_next_B)
    sample = _sample(mean, noise_std_B, inp.prev_sample, generator)
    return StepOutput(sample, _gaussian_log_prob(sample, mean, noise_std_B), mean, noise_std_B)


@STEP_TYPES.register("cps")
def cps_step(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, noise_level: float, *,
             prev_sample: Tensor | None = None, generator: Generators = None) -> StepOutput:  # fmt: skip
    """Coefficients-preserving step: std = sigma_next·sin(noise_level·π/2); log_prob = -(x' - mean)², row-mean."""
    inp = _prepare(x, v, sigma, sigma_next, prev_sample)
    std_B = inp.sigma_next_B * math.sin(noise_level * math.pi / 2)
    std, s, s_next = (_rows(t, inp.x) for t in (std_B, inp.sigma_B, inp.sigma_next_B))  # [B, 1, ...]
    x0 = inp.x - s * inp.v  # predicted clean image
    x1 = inp.x + (1 - s) * inp.v  # predicted noise
    # Clean part keeps its coefficient (1 - sigma_next); of the noise coefficient sigma_next, the share std goes to
    # fresh noise and the rest to the predicted noise, so that the total noise variance stays sigma_next².
    mean = x0 * (1 - s_next) + x1 * torch.sqrt(s_next**2 - std**2)  # >= 0: |sin| <= 1 and fp32 rounding is monotone
    sample = _sample(mean, std_B, inp.prev_sample, generator)
    # The reference's log-prob drops the 1/(2·std²) scale and the normaliser: a per-step constant and scale that
    # it considers harmless for the ratio-based loss. Kept as is so results compare with it.
    log_prob_B = _row_mean(-((sample.detach() - mean) ** 2))
    log_prob_B = torch.where(std_B > 0, log_prob_B, torch.zeros_like(log_prob_B))
    return StepOutput(sample, log_prob_B, mean, std_B)


@STEP_TYPES.register("dance_sde")
def dance_sde_step(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, noise_level: float, *,
                   prev_sample: Tensor | None = None, generator: Generators = None) -> StepOutput:  # fmt: skip
    """DanceGRPO's step with eta = noise_level: Euler step + score term; std = eta·sqrt(sigma - sigma_next)."""
    inp = _prepare(x, v, sigma, sigma_next, prev_sample)
    s = _rows(inp.sigma_B, inp.x)  # [B, 1, ...]
    dt = _rows(inp.sigma_next_B, inp.x) - s
    x0 = inp.x - s * inp.v
    # Score of the Gaussian around the predicted clean image: -(x - (1 - sigma)·x0) / sigma². sigma > 0 always,
    # since sigma > sigma_next >= 0.
    score = -(inp.x - x0 * (1 - s)) / s**2
    mean = inp.x + dt * inp.v - 0.5 * noise_level**2 * score * dt
    std_B = noise_level * torch.sqrt(inp.sigma_B - inp.sigma_next_B)
    sample = _sample(mean, std_B, inp.prev_sample, generator)
    return StepOutput(sample, _gaussian_log_prob(sample, mean, std_B), mean, std_B)


STEP_TYPE_NAMES: tuple[str, ...] = tuple(STEP_TYPES.names())
