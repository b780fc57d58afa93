"""DGPO (Direct Group Preference Optimization, arXiv 2510.08425): Diffusion-DPO's preference lifted from a pair to a
prompt's whole group, each sample weighted by its group-relative advantage, on the final latents of ODE rollouts.

For one group of G samples (cfg: dpo_beta = β, adv_clip_max = c, clip_range = ε, kl_beta), every member noised
at the same t (by default with one ε shared by the group: shared_noise), u_i = ε_i − x0_i:

    e_i     = mean over the non-batch dims of (v_θ,i − u_i)²            the policy's error, with gradient
    e^ref_i = mean (v_ref,i − u_i)²   the frozen reference's (ema_reference: the `old` EMA policy's), no gradient
    Â_i     = clamp(A_i, −c, c)
    s       = β / G · Σ_i Â_i · (e_i − e^ref_i)                          detached
    w       = σ(s)                                                       one weight per group
    loss    = mean over groups and members of w · Â_i · ẽ_i  +  kl_beta · mean over rows of mean (v_θ − v_ref)²

The first term is the gradient of the group preference loss −log σ(−s) divided by β: ∂(−log σ(−s)) = σ(s)·∂s,
with ∂s = β/G · Σ_i Â_i ∂e_i. A group whose better samples (Â > 0) the policy already denoises better than the
reference, and its worse ones worse, has s < 0 and a small weight: like DPO, the preference saturates.

Clip (clip, PPO-style against the `old` EMA policy, e^old_i its error): ratio_i = exp(e^old_i − e_i); a row whose
ratio has moved past 1 + ε for Â_i > 0, or below 1 − ε for Â_i ≤ 0, trains no more: ẽ_i = e_i detached there, e_i
elsewhere; the weights w still see every row. clip_kl detaches the same rows' KL term. Without clip, ẽ = e.

`old` follows the policy after every update: old ← d·old + (1 − d)·θ with d = min(0.3, 0.001·step) (`ramped_decay`
of the steps completed before the update; 0 at first, so the first update copies θ).

Metrics: dgpo/group_weight (mean w), dgpo/margin (mean s), dgpo/clip_fraction, dgpo/mse (mean e),
dgpo/policy_loss, kl_ref (mean (v_θ − v_ref)², 0 without a frozen reference), dgpo/old_decay (when `old` updates).

The update (`Dgpo`): the unit is a whole group (its rows [G]), so a micro-batch holds ⌊train.micro_batch_size / G⌋
groups (at least one) and every worker trains whole groups; K = train_timesteps distinct step indices of the
rollout's schedule, drawn once per (step, epoch) from 0..min(⌊num_steps · timestep_fraction⌋, num_steps − 1) and
shared by every group, one backward pass each; ε per (group or sample, index, epoch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_rl.algorithms.base import LossOutput, LossSettings, UpdatePosition, register_loss
from diffusion_rl.algorithms.preference.base import (
    GroupProcess,
    GroupUnits,
    check_groups,
    detached,
    group_errors,
    metric_mean,
    ramped_decay,
    weighted,
)
from diffusion_rl.config.fields import MAX_STEPS, Range, check, opt
from diffusion_rl.utils.seeding import make_generator

OLD = "old"  # the EMA policy the clip compares with (and, with ema_reference, the preference's reference)


@dataclass
class DgpoInput:
    """One micro-batch of U groups of G rows each."""

    v: torch.Tensor  # [U, G, ...] policy velocity at x_t, with grad
    target: torch.Tensor  # [U, G, ...] u = eps - x0
    advantages: torch.Tensor  # [U, G] each row's group-relative advantage
    v_ref: torch.Tensor | None = None  # [U, G, ...] frozen reference, no grad (the preference's, and the KL's)
    v_old: torch.Tensor | None = None  # [U, G, ...] the `old` EMA policy, no grad (the clip's; ema_reference)
    weights: torch.Tensor | None = None  # [U] per group (0: a group that only pads a worker's share); None: all 1

    def __post_init__(self):
        check_groups(self.v, self.advantages, self.weights, target=self.target, v_ref=self.v_ref, v_old=self.v_old)


def dgpo_timestep_indices(num_steps: int, fraction: float, count: int, generator: torch.Generator) -> torch.Tensor:
    """LongTensor [count]: distinct step indices drawn uniformly (a random ordered subset) from 0..last, last =
    min(⌊num_steps · fraction⌋, num_steps − 1): the high-noise end of the rollout's schedule (index 0 is σ = 1)."""
    last = min(int(num_steps * fraction), num_steps - 1)
    if not 1 <= count <= last + 1:
        raise ValueError(f"dgpo draws train_timesteps={count} distinct step indices from 0..{last}: need 1..{last + 1}")
    return torch.randperm(last + 1, generator=generator)[:count]


@dataclass
class DgpoSettings(LossSettings):
    dpo_beta: float = opt(
        100.0, "β of the group preference σ(β/G · Σ Â·(e − e_ref)) (DGPO's recipes: 100; 10 for PickScore).",
        within=Range(0, 1e6, lo_open=True),
    )  # fmt: skip
    adv_clip_max: float = opt(5.0, "Advantages are clamped to ±this.", within=Range(0, 1000, lo_open=True))
    kl_beta: float = opt(
        0.0, "Weight of mean (v_θ − v_ref)² (DGPO's recipes: 0.02 for OCR and GenEval, 0.001 for PickScore).",
        within=Range(0, 1e4),
    )  # fmt: skip
    clip: bool = opt(True, "PPO-style clip of the error against the `old` EMA policy (DGPO's clip_dsm).")
    clip_range: float = opt(0.01, "ε of the clip's ratio bounds 1 ± ε (DGPO's recipes: 0.01–0.05).",
                            within=Range(0, 100, lo_open=True))  # fmt: skip
    clip_kl: bool = opt(False, "Detach the KL term of the rows the clip stops too (needs kl_beta > 0).")
    train_timesteps: int = opt(
        4, "Distinct step indices trained per step and epoch, one backward pass each.", within=Range(1, MAX_STEPS)
    )
    timestep_fraction: float = opt(
        0.6,
        "Step indices are drawn from 0..min(⌊num_steps × this⌋, num_steps − 1) (DGPO's trunc_steps 6 of 10 steps).",
        within=Range(0, 1),
    )
    shared_noise: bool = opt(True, "One ε per group and timestep, shared by its samples (else one per sample).")
    reference_guidance: float | None = opt(
        None,
        "CFG scale of the frozen reference's velocity (DGPO's kl_cfg, e.g. 4.5 when sampling CFG-free); null: the "
        "conditional prediction, as the policy's.",
        within=Range(1, 100),
    )
    ema_reference: bool = opt(False, "The preference's reference is the `old` EMA policy, not the frozen start.")

    def __post_init__(self):
        check(self.kl_beta > 0 or not self.clip_kl, "algorithm.dgpo.clip_kl clips the KL term: set kl_beta > 0")

    def check_config(self, algorithm, sampling) -> None:
        last = min(int(sampling.num_steps * self.timestep_fraction), sampling.num_steps - 1)
        check(
            self.train_timesteps <= last + 1,
            f"algorithm.dgpo.train_timesteps={self.train_timesteps}: dgpo draws that many distinct steps from 0..{last}"
            " (min(int(sampling.num_steps × timestep_fraction), num_steps − 1)); lower it or raise timestep_fraction",
        )


def keeps_old(settings) -> bool:
    """Whether the `old` EMA policy is kept and run: for the clip, or as the preference's reference."""
    return settings.clip or settings.clip_kl or settings.ema_reference


class Dgpo(GroupProcess):
    @classmethod
    def needs_reference(cls, settings) -> bool:
        return not settings.ema_reference or settings.kl_beta > 0

    @classmethod
    def trained_calls(cls, algorithm, sampling) -> int:
        return algorithm.settings.train_timesteps

    @classmethod
    def frozen_calls(cls, algorithm, sampling, guidance_cost) -> int:
        settings = algorithm.settings
        guidance = 1.0 if settings.reference_guidance is None else settings.reference_guidance
        # true CFG: two rows a call
        return int(cls.needs_reference(settings)) * guidance_cost.forwards(guidance) + int(keeps_old(settings))

    def attach(self, model) -> None:
        super().attach(model)
        if keeps_old(self.settings):
            model.policies.add(OLD)

    def chunks(self, units: GroupUnits) -> int:
        return self.settings.train_timesteps

    def loss(self, units: GroupUnits, k: int, at: UpdatePosition) -> LossOutput:
        s = self.settings
        generator = make_generator(self.seed, at.step, "dgpo_t", at.epoch)
        index = dgpo_timestep_indices(self.sampler.num_steps, s.timestep_fraction, s.train_timesteps, generator)[k]
        per = "group" if s.shared_noise else "sample"
        n = self.noised(units, int(index), at, k, ("dgpo_noise", per, at.epoch), per=per)
        # the frozen forwards first: the reference's then never coincides with the trained forward's activations
        v_ref = self.reference_velocity(n.x_t, n.t, n.cond, s.reference_guidance) if self.needs_reference(s) else None
        v_old = self.velocity_of(OLD, n.x_t, n.t, n.cond) if keeps_old(s) else None
        v = self.velocity(n.x_t, n.t, n.cond)
        inp = DgpoInput(v=n.grouped(v), target=n.target, advantages=units.advantages, v_ref=n.grouped(v_ref),
                        v_old=n.grouped(v_old), weights=units.weight)  # fmt: skip
        return self.loss_fn(inp, s)

    def end(self, step: int) -> dict[str, float]:
        if not keeps_old(self.settings):
            return {}
        decay = ramped_decay(step)  # the optimizer steps before this update's (one per training step)
        self.model.policies.ema_update(OLD, "default", decay)
        return {"dgpo/old_decay": decay}


@register_loss("dgpo", settings=DgpoSettings, algorithm=Dgpo)
def dgpo_loss(inp: DgpoInput, cfg) -> LossOutput:
    """cfg needs dpo_beta, adv_clip_max, kl_beta, clip, clip_range, clip_kl and ema_reference."""
    beta, c, eps, kl_beta = float(cfg.dpo_beta), float(cfg.adv_clip_max), float(cfg.clip_range), float(cfg.kl_beta)
    clipping = cfg.clip or cfg.clip_kl
    reference = inp.v_old if cfg.ema_reference else inp.v_ref
    needs = ((True, reference, "the preference's reference velocity"),
             (clipping, inp.v_old, "v_old (the `old` policy's velocity, for the clip)"),
             (kl_beta > 0, inp.v_ref, "v_ref (the reference's velocity, for kl_beta > 0)"))  # fmt: skip
    for needed, value, name in needs:
        if needed and value is None:
            raise ValueError(f"dgpo needs {name}; got None")

    G = inp.v.shape[1]
    e_UG = group_errors(inp.v, inp.target)
    adv_UG = inp.advantages.detach().float().clamp(-c, c)
    with torch.no_grad():
        e_ref_UG = group_errors(reference, inp.target)
        s_U = beta / G * (adv_UG * (e_UG - e_ref_UG)).sum(dim=1)
        w_U = torch.sigmoid(s_U)
        stopped_UG = torch.zeros_like(e_UG, dtype=torch.bool)
        if clipping:
            ratio_UG = torch.exp(group_errors(inp.v_old, inp.target) - e_UG)
            stopped_UG = torch.where(adv_UG > 0, ratio_UG > 1 + eps, ratio_UG < 1 - eps)
    trained_UG = torch.where(stopped_UG, e_UG.detach(), e_UG) if cfg.clip else e_UG
    w = inp.weights
    policy = weighted((w_U[:, None] * adv_UG * trained_UG).mean(dim=1), w).mean()

    if inp.v_ref is not None:
        kl_UG = group_errors(inp.v, inp.v_ref.detach())
    else:
        kl_UG = torch.zeros_like(e_UG)
    if cfg.clip_kl:
        kl_UG = torch.where(stopped_UG, kl_UG.detach(), kl_UG)
    loss = policy + kl_beta * weighted(kl_UG.mean(dim=1), w).mean() if kl_beta > 0 else policy

    with torch.no_grad():
        metrics = {
            "dgpo/group_weight": metric_mean(w_U, w),
            "dgpo/margin": metric_mean(s_U, w),
            "dgpo/clip_fraction": metric_mean(stopped_UG.float().mean(dim=1), w),
            "dgpo/mse": metric_mean(e_UG.mean(dim=1), w),
            "dgpo/policy_loss": policy,
            "kl_ref": metric_mean(kl_UG.mean(dim=1), w),
        }
    return LossOutput(loss=loss, metrics=detached(metrics))
