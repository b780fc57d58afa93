"""CRD (Centered Reward Distillation, arXiv 2603.14128): the policy's implicit reward, centered within each prompt's
group, regressed onto the group-centered external reward, on the forward process of ODE rollouts' final latents.

For one group of G samples (cfg: crd_beta = β, adv_clip_max = c, kl_beta, weight_floor = f), every member
re-noised at the same t with its own ε, u_i = ε_i − x0_i, and v° the implicit reward's baseline: the `old` EMA
policy (old_reference, the default) or the frozen reference:

    e_i   = mean over the non-batch dims of (v_θ,i − u_i)²,   e°_i = mean (v°_i − u_i)²    (v° without gradient)
    w_i   = max(mean |v_θ,i − u_i|, f),  w°_i = max(mean |v°_i − u_i|, f)   detached (adaptive_logp; else 1)
    r_i   = −(e_i / w_i − e°_i / w°_i)                               the implicit reward, with gradient
    a_i   = clamp(clamp(A_i, −c, c) / (2c) + 1/2, 0, 1)              the external reward, in [0, 1]
    R_i   = a_i − mean_j a_j                                         centered within the group
    ρ_i   = r_i − mean_j r_j                                         the mean detached: only r_i carries gradient
    ℓ     = mean_i (β·ρ_i − R_i)²       (loss_type mse)
          = mean_i BCE-with-logits(β·ρ_i, σ(R_i))                    (loss_type bce)
    loss  = c/β · mean over groups of ℓ  +  kl_beta · mean over rows of k_i · mean (v_θ,i − v_ref,i)²

with k_i = m + a_i·(1 − m), m = 1e-4 / kl_beta, under reward_adaptive_kl (a sample the reward favours is held
closer to the reference: its weight runs from 1e-4 at a = 0 to kl_beta at a = 1), else k_i = 1. v_ref is the
frozen reference's velocity, at CFG scale reference_guidance when it is set (the authors' KL anchor to a
CFG-guided pretrained model), conditional otherwise.

The update (`Crd`): the unit is a whole group (`GroupProcess`); K = train_timesteps step indices of the rollout's
schedule, stratified over the indices whose σ ≥ 1 − timestep_range, drawn once per (step, epoch) and shared by
every group, one backward pass each; ε per (sample, index, epoch). Two EMA policies follow the trained one after
every step n (n = steps completed), policy ← d·policy + (1 − d)·θ:
  `old` (the implicit reward's baseline): d = min(old_decay_start + old_decay_slope·n, old_decay_max);
  `sampling` (samples every rollout: `rollout_policy`): d = 0 for n < sampling_delay (a copy of θ), then
  min(sampling_decay_slope·(n − sampling_delay), sampling_decay_max).

Metrics: crd/policy_loss (c/β·mean ℓ), crd/implicit_reward (mean r), crd/mse (mean e), kl_ref (mean (v_θ − v_ref)²,
0 without a KL), crd/old_decay and crd/sampling_decay (after each step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from diffusion_rl.algorithms.base import LossOutput, LossSettings, UpdatePosition, register_loss
from diffusion_rl.algorithms.preference.base import (
    GroupProcess,
    GroupUnits,
    check_groups,
    detached,
    metric_mean,
    weighted,
)
from diffusion_rl.config.fields import MAX_COUNT, MAX_STEPS, Range, check, opt
from diffusion_rl.utils.seeding import make_generator

OLD = "old"  # the implicit reward's baseline (old_reference)
SAMPLING = "sampling"  # the policy that samples the rollouts
ADAPTIVE_KL_FLOOR = 1e-4  # the KL weight of a sample at a = 0 under reward_adaptive_kl (the authors' base_beta)
SIGMA_TOLERANCE = 1e-6  # a σ this close to the range's edge is inside it (1e-3 on the 1000-step scale)


@dataclass
class CrdInput:
    """One micro-batch of U groups of G rows each."""

    v: torch.Tensor  # [U, G, ...] policy velocity at x_t, with grad
    target: torch.Tensor  # [U, G, ...] u = eps - x0
    advantages: torch.Tensor  # [U, G] each row's group-relative advantage
    v_base: torch.Tensor  # [U, G, ...] the implicit reward's baseline (`old` or the reference), no grad
    v_ref: torch.Tensor | None = None  # [U, G, ...] the KL's reference, no grad; needed when kl_beta > 0
    weights: torch.Tensor | None = None  # [U] per group (0: a group that only pads a worker's share); None: all 1

    def __post_init__(self):
        check_groups(self.v, self.advantages, self.weights, target=self.target, v_base=self.v_base, v_ref=self.v_ref)


def crd_timestep_indices(sigmas: torch.Tensor, timestep_range: float, count: int, gen: torch.Generator) -> torch.Tensor:
    """LongTensor [count]: step indices stratified over lo..hi, the first and last index of the schedule's σs
    (`sigmas` [T], σ_0 = 1, without the final 0) that lie in [1 − timestep_range, 1]: stratum j spans
    ⌊b_j⌋..⌊b_{j+1}⌋ of b = linspace(lo, hi, count + 1) and index j = ⌊b_j⌋ + ⌊u_j·(⌊b_{j+1}⌋ − ⌊b_j⌋)⌋, u_j ~ U[0, 1)
    (so hi itself is drawn only when lo = hi, and indices repeat when count > hi − lo)."""
    inside = torch.nonzero(sigmas.float() >= 1 - timestep_range - SIGMA_TOLERANCE).flatten()
    lo, hi = int(inside.min()), int(inside.max())
    bounds = torch.linspace(lo, hi, count + 1, dtype=torch.float64)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (torch.rand(count, generator=gen, dtype=torch.float64) * (upper - lower)).long()


def linear_decay(step: int, delay: int, start: float, slope: float, cap: float) -> float:
    """The decay d after `step` completed steps: `start` before `delay`, then min(start + slope·(step − delay), cap)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return start if step < delay else min(start + slope * (step - delay), cap)


@dataclass
class CrdSettings(LossSettings):
    crd_beta: float = opt(1.0, "β: the implicit reward is matched as β·r (CRD's recipes: 1).",
                          within=Range(0, 1e6, lo_open=True))  # fmt: skip
    loss_type: Literal["mse", "bce"] = opt("mse", "mse: (β·ρ − R)²; bce: BCE-with-logits(β·ρ, σ(R)).")
    adv_clip_max: float = opt(
        5.0, "Advantages are clamped to ±this, then mapped to [0, 1] as A/(2·this) + 1/2.",
        within=Range(0, 1000, lo_open=True),
    )  # fmt: skip
    adaptive_logp: bool = opt(True, "Divide each error by its own detached mean |v − u| (CRD's adaptive_logp).")
    weight_floor: float = opt(1e-5, "Floor of adaptive_logp's normaliser mean |v − u|.",
                              within=Range(0, 1, lo_open=True))  # fmt: skip
    old_reference: bool = opt(True, "The implicit reward's baseline is the `old` EMA policy (else the frozen start).")
    kl_beta: float = opt(0.1, "Weight of mean (v_θ − v_ref)² (CRD's recipes: 0.1).", within=Range(0, 1e4))
    reward_adaptive_kl: bool = opt(True, "Weigh each sample's KL by 1e-4/kl_beta + a·(1 − 1e-4/kl_beta), a ∈ [0, 1].")
    reference_guidance: float | None = opt(
        4.5, "CFG scale of the KL reference's velocity (CRD's kl_cfg); null: the conditional prediction.",
        within=Range(1, 100),
    )  # fmt: skip
    train_timesteps: int | None = opt(
        None, "Step indices trained per step and epoch, one backward pass each; null: ⌊num_steps × timestep_range⌋.",
        within=Range(1, MAX_STEPS),
    )  # fmt: skip
    timestep_range: float = opt(0.99, "Indices are stratified over the schedule's σs ≥ 1 − this.",
                                within=Range(0, 1, lo_open=True))  # fmt: skip
    old_decay_start: float = opt(
        0.25, "`old`'s decay d before any step; after n: min(start + slope·n, max).", within=Range(0, 1)
    )
    old_decay_slope: float = opt(0.005, "`old`'s decay grows by this per step.", within=Range(0, 1))
    old_decay_max: float = opt(0.999, "`old`'s decay stops growing here.", within=Range(0, 1))
    sampling_delay: int = opt(
        75, "Steps during which the `sampling` policy is a copy of θ.", within=Range(0, MAX_COUNT)
    )
    sampling_decay_slope: float = opt(0.0075, "`sampling`'s decay grows by this per step after the delay.",
                                      within=Range(0, 1))  # fmt: skip
    sampling_decay_max: float = opt(0.999, "`sampling`'s decay stops growing here.", within=Range(0, 1))

    def __post_init__(self):
        check(
            not (self.reward_adaptive_kl and 0 < self.kl_beta < ADAPTIVE_KL_FLOOR),
            f"algorithm.crd.reward_adaptive_kl weighs the KL from {ADAPTIVE_KL_FLOOR:g} up to kl_beta: set kl_beta ≥ "
            f"{ADAPTIVE_KL_FLOOR:g} or reward_adaptive_kl=false (got kl_beta={self.kl_beta:g})",
        )

    def timesteps(self, num_steps: int) -> int:
        """K, the trained step indices per step and epoch."""
        return self.train_timesteps or max(1, int(num_steps * self.timestep_range))


def implicit_baseline(settings) -> str:
    return OLD if settings.old_reference else "reference"


class Crd(GroupProcess):
    rollout_policy = SAMPLING

    @classmethod
    def needs_reference(cls, settings) -> bool:
        return settings.kl_beta > 0 or not settings.old_reference

    @classmethod
    def trained_calls(cls, algorithm, sampling) -> int:
        return algorithm.settings.timesteps(sampling.num_steps)

    @classmethod
    def frozen_calls(cls, algorithm, sampling, guidance_cost) -> int:
        settings = algorithm.settings
        guidance = 1.0 if settings.reference_guidance is None else settings.reference_guidance
        kl = int(settings.kl_beta > 0) * guidance_cost.forwards(guidance)  # true CFG: two rows a call
        # one reference forward for both only when both are its conditional prediction (`loss`): at guidance 1 a
        # guidance-distilled model's prediction is another function
        shared = settings.kl_beta > 0 and not settings.old_reference and settings.reference_guidance is None
        return 1 + kl - int(shared)

    def attach(self, model) -> None:
        super().attach(model)
        model.policies.add(SAMPLING)
        if self.settings.old_reference:
            model.policies.add(OLD)

    def chunks(self, units: GroupUnits) -> int:
        return self.settings.timesteps(self.sampler.num_steps)

    def loss(self, units: GroupUnits, k: int, at: UpdatePosition) -> LossOutput:
        s = self.settings
        generator = make_generator(self.seed, at.step, "crd_t", at.epoch)
        sigmas = self.sigmas[: self.sampler.num_steps]
        index = crd_timestep_indices(sigmas, s.timestep_range, s.timesteps(self.sampler.num_steps), generator)[k]
        n = self.noised(units, int(index), at, k, ("crd_noise", at.epoch))
        # the frozen forwards first: theirs then never coincide with the trained forward's activations
        v_ref = self.reference_velocity(n.x_t, n.t, n.cond, s.reference_guidance) if s.kl_beta > 0 else None
        if v_ref is not None and not s.old_reference and s.reference_guidance is None:
            v_base = v_ref
        else:
            v_base = self.velocity_of(implicit_baseline(s), n.x_t, n.t, n.cond)
        v = self.velocity(n.x_t, n.t, n.cond)
        inp = CrdInput(v=n.grouped(v), target=n.target, advantages=units.advantages, v_base=n.grouped(v_base),
                       v_ref=n.grouped(v_ref), weights=units.weight)  # fmt: skip
        return self.loss_fn(inp, s)

    def end(self, step: int) -> dict[str, float]:
        s, completed = self.settings, step + 1
        metrics = {}
        if s.old_reference:
            d_old = linear_decay(completed, 0, s.old_decay_start, s.old_decay_slope, s.old_decay_max)
            self.model.policies.ema_update(OLD, "default", d_old)
            metrics["crd/old_decay"] = d_old
        d_sampling = linear_decay(completed, s.sampling_delay, 0.0, s.sampling_decay_slope, s.sampling_decay_max)
        self.model.policies.ema_update(SAMPLING, "default", d_sampling)
        metrics["crd/sampling_decay"] = d_sampling
        return metrics


def _errors(v: torch.Tensor, target: torch.Tensor, adaptive: bool, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[U, G, ...] → (e, e / w) [U, G]: mean (v − u)² over each row's non-batch dims, and divided by the detached
    w = max(mean |v − u|, floor) under adaptive_logp. fp32: the implicit reward is a difference of errors ~1e-3
    apart, which bf16 rounds away."""
    diff = (v.float() - target.float()).flatten(2)
    e = diff.pow(2).mean(dim=2)
    if not adaptive:
        return e, e
    return e, e / diff.detach().abs().mean(dim=2).clamp_min(floor)


@register_loss("crd", settings=CrdSettings, algorithm=Crd)
def crd_loss(inp: CrdInput, cfg) -> LossOutput:
    """cfg needs crd_beta, loss_type, adv_clip_max, adaptive_logp, weight_floor, kl_beta and reward_adaptive_kl."""
    beta, c, kl_beta = float(cfg.crd_beta), float(cfg.adv_clip_max), float(cfg.kl_beta)
    if kl_beta > 0 and inp.v_ref is None:
        raise ValueError("kl_beta > 0 needs v_ref (the reference policy's velocity); got None")

    e_UG, scaled_UG = _errors(inp.v, inp.target, cfg.adaptive_logp, cfg.weight_floor)
    with torch.no_grad():
        _, scaled_base_UG = _errors(inp.v_base, inp.target, cfg.adaptive_logp, cfg.weight_floor)
        a_UG = (inp.advantages.float().clamp(-c, c) / (2 * c) + 0.5).clamp(0, 1)
        R_UG = a_UG - a_UG.mean(dim=1, keepdim=True)
    r_UG = scaled_base_UG - scaled_UG
    rho_UG = r_UG - r_UG.detach().mean(dim=1, keepdim=True)
    if cfg.loss_type == "bce":
        per_UG = F.binary_cross_entropy_with_logits(beta * rho_UG, torch.sigmoid(R_UG), reduction="none")
    else:
        per_UG = (beta * rho_UG - R_UG).pow(2)
    w = inp.weights
    policy = c / beta * weighted(per_UG.mean(dim=1), w).mean()

    if inp.v_ref is not None:
        kl_UG = (inp.v.float() - inp.v_ref.detach().float()).flatten(2).pow(2).mean(dim=2)
    else:
        kl_UG = torch.zeros_like(e_UG)
    if kl_beta > 0:
        floor = ADAPTIVE_KL_FLOOR / kl_beta
        k_UG = floor + a_UG * (1 - floor) if cfg.reward_adaptive_kl else torch.ones_like(a_UG)
        loss = policy + kl_beta * weighted((k_UG * kl_UG).mean(dim=1), w).mean()
    else:
        loss = policy

    with torch.no_grad():
        metrics = {
            "crd/policy_loss": policy,
            "crd/implicit_reward": metric_mean(r_UG.mean(dim=1), w),
            "crd/mse": metric_mean(e_UG.mean(dim=1), w),
            "kl_ref": metric_mean(kl_UG.mean(dim=1), w),
        }
    return LossOutput(loss=loss, metrics=detached(metrics))
