"""ODE solvers for the deterministic steps of a rollout (the steps outside the SDE window).

The flow ODE is dx/dσ = v(x, σ) with x_σ = (1 − σ)·x0 + σ·noise; the model's data prediction is x0̂ = x − σ·v.
Every solver here uses one velocity evaluation per step (the sampler loop makes it), so switching solvers never
changes the number of model calls; only how a step uses the evaluations it has seen.

- `euler`: x_next = x + (σ_next − σ)·v. First order (the global error falls as 1/N in the number of steps N).
- `dpm2`: DPM-Solver++(2M) (Lu et al. 2022, arXiv 2211.01095, Alg. 2) written for rectified flow, as MixGRPO-Flash
  (Li et al. 2025, arXiv 2507.21802) uses it for the ODE steps after its SDE window. With α = 1 − σ and
  λ = log(α/σ), DPM-Solver++'s first-order step x_next = (σ_next/σ)·x + α_next·(1 − e^{−h})·x0̂ (h = λ_next − λ)
  simplifies, because α_next·(1 − e^{−h}) = 1 − σ_next/σ on this path, to

      x_next = (σ_next/σ)·x + (1 − σ_next/σ)·D

  with D = x0̂ — exactly the Euler step. The second-order multistep form replaces D by a linear extrapolation of
  the data prediction in λ, from this step's x0̂ and the previous step's x0̂_prev (at σ_prev, h_prev = λ − λ_prev):

      D = x0̂ + (h / (2·h_prev))·(x0̂ − x0̂_prev),
      so x_next = x_euler + (1 − σ_next/σ)·(h / (2·h_prev))·(x0̂ − x0̂_prev).

  The same one model call per step, second order in the largest λ step (global error ∝ 1/N² on a schedule
  uniform in λ). On the σ-uniform (shifted) schedules of flow models the λ steps next to σ = 0 and σ = 1 stay about
  log 2 however large N is, and the measured order drops to about 1.5 (tests/sampling/test_ode_solver.py).
  It takes the first-order (Euler) step instead
  * from a previous point at σ_prev = 1 (λ_prev = −∞: the correction's weight h/(2·h_prev) is 0 there anyway);
  * into σ_next = 0 (λ_next = +∞: h is infinite and the formula breaks down; DPM-Solver++ and diffusers'
    `final_sigmas_type="zero"` take a first-order step there too).
- `ab2`: the two-step Adams–Bashforth method on the velocity in σ, with h = σ_next − σ, h_prev = σ − σ_prev:

      x_next = x + h·v + (h² / (2·h_prev))·(v − v_prev)

  Second order on any schedule whose σ steps shrink as 1/N (the shifted ones included), with no special case at
  σ = 0 or 1: σ stays finite at both ends of the schedule, where λ runs off to ±∞.

Both multistep solvers take a first-order (Euler) step where they have no sound history:
  * the first step of a rollout;
  * the first ODE step after an SDE step (`reset`). x0̂_prev was predicted at the point the SDE step left, and
    that step added fresh noise: the difference x0̂ − x0̂_prev (v − v_prev) then holds the noise's effect
    (order of the noise, not of h), and extrapolating it would re-inject part of that noise with a weight of
    about 1/2. Restarting costs one first-order step and keeps every ODE step a step of the ODE through the
    current point. (MixGRPO's code keeps the history across the window; we do not: on the tiny model
    keeping it lands further from the exact ODE solution, benchmarks/RESULTS.md.)
A first-order step (local error O(h²)) at a fixed number of places keeps the global order at 2. Up to the first
multistep step the solvers are bit-identical to `euler`, and SDE steps never change: the solvers only differ on
ODE steps that follow an ODE step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diffusion_rl.config.plugins import ODE_SOLVERS
from diffusion_rl.sampling.sde import ode_step


@dataclass(frozen=True)
class Multistep:
    """A second-order solver: the quantity it extrapolates (fp32) and the weight of (this step's − the previous
    step's) added to the Euler step, from (σ_prev, σ, σ_next); a weight of None takes the first-order step."""

    quantity: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    weight: Callable[[float, float, float], float | None]


def _lambda(sigma: float) -> float:
    """λ = log((1 − σ)/σ), the log signal-to-noise half-ratio; finite for 0 < σ < 1."""
    return math.log1p(-sigma) - math.log(sigma)


def _dpm2_weight(sigma_prev: float, sigma: float, sigma_next: float) -> float | None:
    if sigma_next <= 0 or sigma_prev >= 1:  # λ infinite: first order (see the module docstring)
        return None
    h = _lambda(sigma_next) - _lambda(sigma)
    h_prev = _lambda(sigma) - _lambda(sigma_prev)
    return (1 - sigma_next / sigma) * h / (2 * h_prev)


def _ab2_weight(sigma_prev: float, sigma: float, sigma_next: float) -> float:
    h, h_prev = sigma_next - sigma, sigma - sigma_prev
    return h * h / (2 * h_prev)


ODE_SOLVERS.register("euler")(None)  # first order: no history
ODE_SOLVERS.register("dpm2")(Multistep(lambda x, v, sigma: x.float() - sigma * v.float(), _dpm2_weight))  # x0̂
ODE_SOLVERS.register("ab2")(Multistep(lambda x, v, sigma: v.float(), _ab2_weight))  # the velocity
ODE_SOLVER_NAMES: tuple[str, ...] = tuple(ODE_SOLVERS.names())


class OdeSolver:
    """Advances x through the deterministic steps of one rollout; holds the multistep history (one [B, …] tensor
    and its σ)."""

    def __init__(self, name: str):
        if name not in ODE_SOLVERS:
            raise ValueError(f"unknown ODE solver '{name}'; known: {', '.join(ODE_SOLVER_NAMES)}")
        self.name = name
        self._multistep: Multistep | None = ODE_SOLVERS.get(name)
        self._prev: tuple[torch.Tensor, float] | None = None  # (x0̂ for dpm2, v for ab2; fp32) and its σ

    def reset(self) -> None:
        """Forget the history: the next step is first order (called after a stochastic step)."""
        self._prev = None

    def step(self, x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
        """x at σ_next (fp32) from x at σ and the velocity v there."""
        x_next = ode_step(x, v, sigma, sigma_next, 0.0).prev_sample  # the first-order (Euler) step
        if self._multistep is None:
            return x_next
        current = self._multistep.quantity(x, v, sigma)
        prev, self._prev = self._prev, (current, sigma)
        if prev is None:
            return x_next
        previous, sigma_prev = prev
        weight = self._multistep.weight(sigma_prev, sigma, sigma_next)
        return x_next if weight is None else x_next + weight * (current - previous)
