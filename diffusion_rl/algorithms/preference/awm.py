"""Advantage-Weighted Matching (AWM): PPO-clip on a flow-matching "likelihood" of the forward process.

Each row n is one (timestep, sample) pair of a micro-batch: x_t = (1 - t_n) * x0 + t_n * eps, u = eps - x0.
With cfg: clip_range, adv_clip_max = c, advantage_max, weighting, kl_beta = beta_ref, ema_beta = beta_ema:

    mse_n      = mean over the non-batch dims of (v_theta,n - u_n)^2            float64
    log p_n    = awm_log_p(mse_n, t_n, weighting) = -w(mse_n, t_n)
    A^_n       = clamp(A_n, -c, c) / c * advantage_max
    ratio_n    = exp(log p_theta,n - log p_old,n)                                log p_old without gradient
    loss       = mean_n max(-A^_n * ratio_n, -A^_n * clamp(ratio_n, 1 - clip_range, 1 + clip_range))
                 + beta_ref * mean_n mean (v_theta - v_ref)^2 + beta_ema * mean_n mean (v_theta - v_ema)^2

Weightings w(mse, t): "uniform" mse; "t" t * mse; "ghuber" t * ((mse + 1e-10)^p - 1e-10^p) / p with p = 0.25
(a generalised Huber: it grows like mse^p, so rows with a large error do not dominate the gradient).

log p_old is computed by the caller with awm_log_p on a no_grad pass of the policy that sampled (same x_t, same
eps); on-policy it equals log p_theta in value, so the ratio is 1 and the loss is advantage-weighted matching.
AWM's reference recipes use clip_range 1 (the config default; Flow-GRPO's 1e-4 would clip nearly every row).
The KL terms are the plain velocity gaps ("Uniform" in AWM's reference), not divided by a step variance.

Metrics: awm/ratio_mean, awm/clip_fraction (|ratio - 1| > clip_range), awm/mse (mean mse_theta),
awm/policy_loss, kl_ref (mean (v_theta - v_ref)^2, 0 without v_ref), awm/ema_gap (the same to v_ema).

The update (`Awm`): K = train_timesteps stratified step indices per mini-batch (`awm_timestep_indices`),
one backward pass each; eps per (sample, index), the same in every epoch, so the ratio's log p_old (under the
weights that sampled, computed before the first optimizer step when there are several) stays valid across the
update's optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from tensordict import tensorclass

from diffusion_rl.algorithms.base import (
    LossOutput,
    LossSettings,
    TrainBatch,
    UpdatePosition,
    minibatch_rows,
    register_loss,
)
from diffusion_rl.algorithms.preference.base import (
    ForwardProcess,
    batch_rows,
    check_same_shape,
    check_vectors,
    detached,
    forward_noise,
    metric_mean,
    noise_like,
    ramped_decay,
    row_mean,
    weighted,
)
from diffusion_rl.config.fields import MAX_STEPS, Range, check, opt
from diffusion_rl.sampling.trajectory import Trajectory
from diffusion_rl.utils.seeding import make_generator

WEIGHTINGS = ("uniform", "t", "ghuber")
GHUBER_POWER = 0.25
GHUBER_EPS = 1e-10  # keeps the power's gradient finite at mse = 0


@dataclass
class AwmInput:
    """One micro-batch flattened to N = (trained timesteps x samples) rows."""

    v: torch.Tensor  # [N, ...] policy velocity at x_t, with grad
    target: torch.Tensor  # [N, ...] u = eps - x0
    t: torch.Tensor  # [N] sigma in [0, 1] of each row
    log_p_old: torch.Tensor  # [N] awm_log_p under the weights that sampled, no grad
    advantages: torch.Tensor  # [N] the row's sample's advantage
    v_ref: torch.Tensor | None = None  # [N, ...] reference velocity, no grad; needed when kl_beta > 0
    v_ema: torch.Tensor | None = None  # [N, ...] EMA velocity, no grad; needed when ema_beta > 0
    weights: torch.Tensor | None = None  # [N] per row (0: a row that only pads a worker's share); None: all 1

    def __post_init__(self):
        rows = batch_rows("v", self.v)
        check_same_shape(self.v, "v", target=self.target, v_ref=self.v_ref, v_ema=self.v_ema)
        check_vectors(rows, t=self.t, log_p_old=self.log_p_old, advantages=self.advantages, weights=self.weights)


def awm_log_p(mse: torch.Tensor, t: torch.Tensor, weighting: str) -> torch.Tensor:
    """[N], [N] -> [N] float64: -w(mse, t) for weighting in WEIGHTINGS (see the module docstring)."""
    # float64: on-policy the ratio is exp of a difference of two nearly equal numbers
    mse, t = mse.double(), t.double()
    if weighting == "uniform":
        return -mse
    if weighting == "t":
        return -t * mse
    if weighting == "ghuber":
        p = GHUBER_POWER
        return -t * ((mse + GHUBER_EPS) ** p - GHUBER_EPS**p) / p
    raise ValueError(f"unknown AWM weighting '{weighting}'; known: {', '.join(WEIGHTINGS)}")


def _gap(v: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
    """[N]: mean (v - other)^2 per row; zeros when other is None."""
    if other is None:
        return torch.zeros(v.shape[0], device=v.device)
    return row_mean((v.float() - other.detach().float()).pow(2))


def awm_timestep_indices(num_timesteps: int, train_steps: int, generator: torch.Generator) -> torch.Tensor:
    """LongTensor [K = num_timesteps]: one step index drawn uniformly in each of K strata of 1, ..., train_steps - 1.

    train_steps = int(num_steps * timestep_fraction); the candidates are the M = train_steps - 1 indices
    1, ..., train_steps - 1 (the half-open [1, train_steps), as AWM's reference does: index 0 is pure noise and
    index train_steps is outside the trained fraction). Stratum k (k = 0, ..., K - 1) is the integers
    [1 + floor(k * M / K), 1 + floor((k + 1) * M / K)); when K does not divide M the strata sizes differ by one,
    the larger ones falling where the floors step twice (e.g. M = 9, K = 6: sizes 1, 2, 1, 2, 1, 2). Every stratum
    holds at least one index, so the K indices are distinct and increasing; K > M is an error (the reference then
    repeats indices silently).
    """
    k, m = num_timesteps, train_steps - 1
    if k < 1:
        raise ValueError(f"train_timesteps must be >= 1, got {k}")
    if k > m:
        raise ValueError(
            f"AWM draws train_timesteps={k} distinct step indices from 1..{m} (= int(num_steps * timestep_fraction)"
            f" - 1 = {train_steps} - 1): lower train_timesteps to <= {max(m, 0)} or raise num_steps or "
            "timestep_fraction"
        )
    strata = torch.arange(k + 1, dtype=torch.long)
    bounds = 1 + (strata * m) // k  # [K + 1] integer stratum edges
    lo_K, size_K = bounds[:-1], bounds[1:] - bounds[:-1]
    u_K = torch.rand(k, generator=generator, device=generator.device, dtype=torch.float64)
    offset_K = (u_K * size_K.to(u_K.device)).floor().long()
    return lo_K.to(u_K.device) + offset_K


@dataclass
class AwmSettings(LossSettings):
    clip_range: float = opt(
        1.0,
        "PPO ratio clip range (AWM's recipes: 1; Flow-GRPO's 1e-4 would clip nearly every row).",
        within=Range(0, 100, lo_open=True),
    )
    adv_clip_max: float = opt(
        5.0, "Advantages are clamped to ±this, then scaled to ±advantage_max.", within=Range(0, 1000, lo_open=True)
    )
    advantage_max: float = opt(1.0, "Scale of the clamped advantages.", within=Range(0, 1000, lo_open=True))
    kl_beta: float = opt(0.0, "Weight of mean (v_θ − v_ref)² (0 = off: no reference forward).", within=Range(0, 1e4))
    ema_beta: float = opt(
        0.0,
        "Weight of mean (v_θ − v_ema)² (> 0 keeps an `ema` adapter, d = min(0.3, 0.001·step)).",
        within=Range(0, 1e4),
    )
    timestep_fraction: float = opt(
        1.0, "Step indices are drawn from 1..int(num_steps × this) − 1.", within=Range(0, 1, lo_open=True)
    )
    train_timesteps: int = opt(
        6, "Step indices trained per mini-batch, one from each of this many strata.", within=Range(1, MAX_STEPS)
    )
    weighting: Literal["uniform", "t", "ghuber"] = opt(
        "ghuber", "log p̂ = −w(mse, t): uniform (mse), t (t·mse), ghuber (t·((mse + 1e-10)^¼ − 1e-10^¼)·4)."
    )

    def check_config(self, algorithm, sampling) -> None:
        candidates = int(sampling.num_steps * self.timestep_fraction) - 1
        check(
            self.train_timesteps <= candidates,
            f"algorithm.awm.train_timesteps={self.train_timesteps}: awm draws that many distinct steps from "
            f"1..{candidates} (int(sampling.num_steps × timestep_fraction) − 1); lower it or raise sampling.num_steps",
        )


@tensorclass
class AwmUnits:
    """The update's units: one row per sample, with its mini-batch's step indices and (several optimizer steps)
    the log p̂ under the weights that sampled."""

    traj: Trajectory
    advantages: torch.Tensor  # [B]
    t_indices: torch.Tensor  # [B, K] long: the step indices of the row's mini-batch (the same within one)
    weight: torch.Tensor  # [B] 1, or 0 for a sample that only pads this worker's share
    log_p_old: torch.Tensor | None = None  # [B, K] float64; None: the update's only optimizer step computes it


class Awm(ForwardProcess):
    @classmethod
    def trained_calls(cls, algorithm, sampling) -> int:
        return algorithm.settings.train_timesteps

    @classmethod
    def frozen_calls(cls, algorithm, sampling, guidance_cost) -> int:
        # the EMA's velocity, and the reference's
        return int(algorithm.settings.ema_beta > 0) + super().frozen_calls(algorithm, sampling, guidance_cost)

    def attach(self, model) -> None:
        super().attach(model)
        if self.settings.ema_beta > 0:
            model.policies.add("ema")

    def chunks(self, units: AwmUnits) -> int:
        return self.settings.train_timesteps

    def begin(self, batch: TrainBatch, step: int) -> tuple[AwmUnits, dict[str, float]]:
        s, traj = self.settings, batch.traj
        B, M = traj.batch_size[0], self.num_minibatches
        train_steps = int(self.sampler.num_steps * s.timestep_fraction)
        t_indices = torch.zeros(B, s.train_timesteps, dtype=torch.long)
        for m in range(M):
            generator = make_generator(self.seed, step, "awm_t", m)
            t_indices[minibatch_rows(B, M, m)] = awm_timestep_indices(s.train_timesteps, train_steps, generator)
        units = AwmUnits(traj=traj, advantages=batch.targets.advantages, t_indices=t_indices.to(traj.device),
                         weight=torch.ones(B, device=traj.device), batch_size=traj.batch_size)  # fmt: skip
        if M * self.ppo_epochs > 1:  # later optimizer steps see changed weights: keep the sampling ones' log p̂
            units.log_p_old = self._log_p_now(units, step)
        return units, {}

    @torch.no_grad()
    def _log_p_now(self, units: AwmUnits, step: int) -> torch.Tensor:
        """[B, K] float64 log p̂ of every (row, chunk) under the current weights."""
        out = torch.zeros(units.batch_size[0], self.chunks(units), dtype=torch.float64)
        M = self.num_minibatches
        for m in range(M):
            for micro in minibatch_rows(units.batch_size[0], M, m).split(self.micro_size):  # `out`'s, the host's
                chunk = units[micro.to(units.weight.device)]
                for k in range(self.chunks(units)):
                    x_t, t_B, eps, x0 = self._draw(chunk, k, step)
                    mse = row_mean((self.velocity(x_t, t_B, chunk.traj.cond).double() - (eps - x0)) ** 2)
                    out[micro, k] = awm_log_p(mse, t_B, self.settings.weighting).cpu()
        return out.to(units.device)

    def _draw(self, units: AwmUnits, k: int, step: int):
        traj = units.traj
        t_B = self.sigmas[units.t_indices[:, k].cpu()].to(traj.device)
        x0 = traj.final_latents.float()
        generators = [make_generator(self.seed, step, "awm_noise", int(i), k) for i in traj.ids.sample_index]
        eps = noise_like(x0, generators)
        return forward_noise(x0, eps, t_B), t_B, eps, x0

    def loss(self, units: AwmUnits, k: int, at: UpdatePosition) -> LossOutput:
        x_t, t_B, eps, x0 = self._draw(units, k, at.step)
        cond = units.traj.cond
        v = self.velocity(x_t, t_B, cond)
        target = eps - x0
        s = self.settings
        if units.log_p_old is None:  # the only optimizer step: the current weights are the ones that sampled
            log_p_old = awm_log_p(row_mean((v.detach().double() - target.double()) ** 2), t_B, s.weighting)
        else:
            log_p_old = units.log_p_old[:, k]
        inp = AwmInput(
            v=v,
            target=target,
            t=t_B,
            log_p_old=log_p_old.to(v.device),
            advantages=units.advantages,
            v_ref=self.velocity_of("reference", x_t, t_B, cond) if s.kl_beta > 0 else None,
            v_ema=self.velocity_of("ema", x_t, t_B, cond) if s.ema_beta > 0 else None,
            weights=units.weight,
        )
        return self.loss_fn(inp, s)

    def end(self, step: int) -> dict[str, float]:
        if self.settings.ema_beta <= 0:
            return {}
        decay = ramped_decay(step + 1)
        self.model.policies.ema_update("ema", "default", decay)
        return {"awm/ema_decay": decay}


@register_loss("awm", settings=AwmSettings, algorithm=Awm)
def awm_loss(inp: AwmInput, cfg) -> LossOutput:
    """cfg needs clip_range, adv_clip_max, advantage_max, weighting, kl_beta and ema_beta."""
    clip_range, c = float(cfg.clip_range), float(cfg.adv_clip_max)
    kl_beta, ema_beta = float(cfg.kl_beta), float(cfg.ema_beta)
    if c <= 0:
        raise ValueError(f"adv_clip_max must be > 0 (advantages are divided by it); got {c}")
    if kl_beta > 0 and inp.v_ref is None:
        raise ValueError("kl_beta > 0 needs v_ref (the reference policy's velocity); got None")
    if ema_beta > 0 and inp.v_ema is None:
        raise ValueError("ema_beta > 0 needs v_ema (the EMA policy's velocity); got None")

    mse_N = row_mean((inp.v.double() - inp.target.double()).pow(2))
    log_ratio_N = awm_log_p(mse_N, inp.t, cfg.weighting) - inp.log_p_old.detach().double()
    ratio_N = torch.exp(log_ratio_N)
    adv_N = inp.advantages.double().clamp(-c, c) / c * float(cfg.advantage_max)
    unclipped_N = -adv_N * ratio_N
    clipped_N = -adv_N * ratio_N.clamp(1.0 - clip_range, 1.0 + clip_range)
    w = inp.weights
    policy = weighted(torch.maximum(unclipped_N, clipped_N), w).mean().float()

    kl_N, ema_N = _gap(inp.v, inp.v_ref), _gap(inp.v, inp.v_ema)
    loss = policy
    if kl_beta > 0:
        loss = loss + kl_beta * weighted(kl_N, w).mean()
    if ema_beta > 0:
        loss = loss + ema_beta * weighted(ema_N, w).mean()

    with torch.no_grad():
        metrics = {
            "awm/ratio_mean": metric_mean(ratio_N, w).float(),
            "awm/clip_fraction": metric_mean(((ratio_N - 1.0).abs() > clip_range).float(), w),
            "awm/mse": metric_mean(mse_N, w).float(),
            "awm/policy_loss": policy,
            "kl_ref": metric_mean(kl_N, w),
            "awm/ema_gap": metric_mean(ema_N, w),
        }
    return LossOutput(loss=loss, metrics=detached(metrics))
