"""DiffusionNFT: flow matching toward an implicit positive policy and away from an implicit negative one.

Per sample i of a micro-batch (cfg: nft_beta = beta, adv_clip_max = c, kl_beta = beta_KL, weight_floor = f,
reward_mode):

    a_i     = clamp(A_i, -c, c), then by reward_mode:
                continuous     a_i                      (DiffusionNFT's default)
                positive_only  max(a_i, 0)              only the better samples pull toward v+; the rest sit at 1/2
                negative_only  min(a_i, 0)              only the worse samples push away; the rest sit at 1/2
                one_only       1 if a_i > 0 else 0      r = 1/2 + 1/(2c) for the better half, 1/2 for the rest
                binary         sign(a_i)                r = 1/2 ± 1/(2c), 1/2 at A = 0
    r_i     = clamp(a_i / (2c) + 1/2, 0, 1)                          how much sample i counts as a positive
    v+      = beta * v_theta + (1 - beta) * v_old                    implicit positive policy
    v-      = (1 + beta) * v_old - beta * v_theta                    its mirror image around v_old
    x0+-    = x_t - t_i * v+-                                        their clean-sample predictions
    w+-_i   = max(mean |x0+- - x0|, f), without gradient             per-sample adaptive normaliser
    pos_i   = mean (x0+ - x0)^2 / w+_i,   neg_i = mean (x0- - x0)^2 / w-_i
    pol_i   = (r_i * pos_i + (1 - r_i) * neg_i) / beta
    loss    = c * mean_i pol_i + beta_KL * mean_i mean (v_theta - v_ref)^2

means without an index run over the non-batch dims. c is a pure scale of the policy term; dividing by beta
cancels the beta that v+- bring into the gradient (d x0+- / d v_theta = -+ t * beta), so a small beta does not
shrink the update. v_old is the slowly-updated "old" adapter that sampled the rollouts (see `old_decay`);
v_ref is the frozen base model and is only needed when kl_beta > 0. The modes one_only and binary map the sign of
the advantage to ±1 BEFORE dividing by 2c, as the reference code does, so their r moves only 1/(2c) from 1/2
(0.1 at c = 5); a smaller adv_clip_max makes them stronger. The floor f (1e-5 in DiffusionNFT)
keeps a near-perfect prediction from blowing the loss up.

Metrics: nft/r_mean, nft/policy_loss (c * mean pol_i, the term in the loss), nft/positive_loss and
nft/negative_loss (mean pos_i and mean neg_i, before r and c), kl_ref (mean (v_theta - v_ref)^2, 0 without v_ref),
nft/old_gap (mean (v_theta - v_old)^2); means over the samples that carry weight.

The update (`Nft`): the `old` adapter samples the rollouts; each sample trains at a seeded subset of the rollout
schedule's sigmas (timestep_fraction of them), one per backward pass; after every `old_update_interval` steps
`old` moves toward the policy by the decay schedule (`old_decay`). Its advantages are the group advantages
of algorithm.advantage (std with `std_ddof`, 0 by default as in DiffusionNFT's own code; verl-omni's is 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from tensordict import tensorclass

from diffusion_rl.algorithms.base import LossOutput, LossSettings, TrainBatch, UpdatePosition, register_loss
from diffusion_rl.algorithms.preference.base import (
    ForwardProcess,
    batch_rows,
    check_same_shape,
    check_vectors,
    detached,
    forward_noise,
    metric_mean,
    noise_like,
    row_mean,
    weighted,
)
from diffusion_rl.config.fields import MAX_COUNT, Range, check, opt
from diffusion_rl.sampling.trajectory import Trajectory
from diffusion_rl.utils.seeding import make_generator

MIN_WEIGHT = 1e-5  # DiffusionNFT's floor of the adaptive normaliser (the default of `weight_floor`)
REWARD_MODES = ("continuous", "positive_only", "negative_only", "one_only", "binary")


@dataclass
class NftInput:
    """One micro-batch of B samples at one forward-process time each."""

    v: torch.Tensor  # [B, ...] policy velocity at x_t, with grad
    v_old: torch.Tensor  # [B, ...] old-adapter velocity, no grad
    v_ref: torch.Tensor | None  # [B, ...] reference velocity, no grad; None when kl_beta = 0
    x_t: torch.Tensor  # [B, ...] (1 - t) * x0 + t * eps
    x0: torch.Tensor  # [B, ...] the rollout's clean final latent
    t: torch.Tensor  # [B] sigma in [0, 1]
    advantages: torch.Tensor  # [B]
    weights: torch.Tensor | None = None  # [B] per sample (0: a sample that only pads a worker's share); None: all 1

    def __post_init__(self):
        batch = batch_rows("v", self.v)
        check_same_shape(self.v, "v", v_old=self.v_old, v_ref=self.v_ref, x_t=self.x_t, x0=self.x0)
        check_vectors(batch, t=self.t, advantages=self.advantages, weights=self.weights)


def reward_probability(advantages: torch.Tensor, adv_clip_max: float, mode: str = "continuous") -> torch.Tensor:
    """[B] -> [B]: r = clamp(a / (2c) + 1/2, 0, 1) with a = clamp(A, -c, c) transformed by `mode` (module
    docstring); continuous: A = c gives 1, A = 0 gives 1/2, A = -c gives 0."""
    c = float(adv_clip_max)
    a = advantages.float().clamp(-c, c)
    if mode == "positive_only":
        a = a.clamp_min(0.0)
    elif mode == "negative_only":
        a = a.clamp_max(0.0)
    elif mode == "one_only":
        a = (a > 0).float()
    elif mode == "binary":
        a = torch.sign(a)
    elif mode != "continuous":
        raise ValueError(f"reward_mode must be one of {list(REWARD_MODES)}, got {mode!r}")
    return (a / (2 * c) + 0.5).clamp(0.0, 1.0)


OLD_DECAY_KINDS: dict[str, tuple[int, float, float]] = {
    # kind: (flat steps w, rate per step, cap); d(step) = 0 if step < w else min((step - w) * rate, cap)
    "copy": (0, 0.0, 0.0),
    "linear_to_0_5": (0, 0.001, 0.5),
    "delayed_linear_to_0_999": (75, 0.0075, 0.999),
}


def old_decay(step: int, kind: str, fixed: float | None = None) -> float:
    """DiffusionNFT's decay d of the "old" adapter after `step` completed trainer steps.

    kind is one of OLD_DECAY_KINDS, or "fixed" with `fixed` the constant d in [0, 1]. DiffusionNFT's default recipe
    takes "linear_to_0_5" (its `decay_type = 1`, with β 1; the default here), its SD3 OCR recipe
    "delayed_linear_to_0_999" (`decay_type = 2`, with β 0.1): the old adapter tracks the policy exactly for the first
    75 steps, then lags more and more (d = 0.1875 at step 100, 0.9375 at step 200, 0.999 from step 209 on).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if kind == "fixed":
        if fixed is None or not 0.0 <= fixed <= 1.0:
            raise ValueError(f"old decay kind 'fixed' needs a constant decay in [0, 1]; got {fixed}")
        return float(fixed)
    if fixed is not None:
        raise ValueError(f"a fixed old decay ({fixed}) only goes with kind 'fixed', not '{kind}'")
    if kind not in OLD_DECAY_KINDS:
        raise ValueError(f"unknown old decay kind '{kind}'; known: {', '.join([*OLD_DECAY_KINDS, 'fixed'])}")
    flat, rate, cap = OLD_DECAY_KINDS[kind]
    return 0.0 if step < flat else min((step - flat) * rate, cap)


def nft_timestep_indices(num_steps: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """LongTensor [K]: the first K = max(1, int(num_steps * fraction)) entries of a permutation of range(num_steps).

    The caller passes one generator per sample (seeded from (seed, step, sample index)) and trains at the rollout
    schedule's sigmas at these indices.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not 0 < fraction <= 1:
        raise ValueError(f"timestep fraction must be in (0, 1], got {fraction}")
    k = max(1, int(num_steps * fraction))
    return torch.randperm(num_steps, generator=generator, device=generator.device)[:k]


@dataclass
class NftSettings(LossSettings):
    nft_beta: float = opt(
        1.0,
        "β of the implicit policies v± = old ± β·(v_θ − old) (0.1 in NFT's OCR recipe).",
        within=Range(0, 1000, lo_open=True),
    )
    adv_clip_max: float = opt(
        5.0, "Advantages are clamped to ±this; r = clamp(A)/(2·this) + 1/2.", within=Range(0, 1000, lo_open=True)
    )
    kl_beta: float = opt(
        1e-4,
        "Weight of mean (v_θ − v_ref)² (0 = off: no reference forward). DiffusionNFT's 1e-4.",
        within=Range(0, 1e4),
    )
    timestep_fraction: float = opt(
        0.99,
        "Fraction of the rollout schedule's σs each sample trains at (NFT's 0.99).",
        within=Range(0, 1, lo_open=True),
    )
    old_update_interval: int = opt(
        1, "Update the `old` adapter (which samples) every N training steps.", within=Range(1, MAX_COUNT)
    )
    old_decay: Literal["copy", "linear_to_0_5", "delayed_linear_to_0_999", "fixed"] = opt(
        "linear_to_0_5",  # DiffusionNFT's default recipe (decay_type 1, with β 1); its SD3 OCR recipe: delayed, β 0.1
        "d of old ← d·old + (1 − d)·θ after `step` completed steps: copy (0), linear_to_0_5 (min(0.001·step, 0.5)), "
        "delayed_linear_to_0_999 (0 before step 75, then min(0.0075·(step − 75), 0.999)), fixed (old_decay_value).",
    )
    old_decay_value: float | None = opt(None, "The constant d of old_decay=fixed.", within=Range(0, 1))
    reward_mode: Literal["continuous", "positive_only", "negative_only", "one_only", "binary"] = opt(
        "continuous",
        "How the clamped advantage a becomes r = a/(2·adv_clip_max) + 1/2: continuous (a), positive_only (max(a, 0)), "
        "negative_only (min(a, 0)), one_only (1 if a > 0 else 0), binary (sign a).",
    )
    weight_floor: float = opt(
        MIN_WEIGHT,
        "Floor of the adaptive normaliser mean |x0± − x0| (DiffusionNFT's 1e-5).",
        within=Range(0, 1, lo_open=True),
    )

    def __post_init__(self):
        if self.old_decay == "fixed":
            check(self.old_decay_value is not None, "old_decay=fixed needs old_decay_value, a number in [0, 1]")
        else:
            check(
                self.old_decay_value is None,
                f"old_decay_value={self.old_decay_value} only goes with old_decay=fixed (got old_decay="
                f"{self.old_decay}); set old_decay=fixed or remove old_decay_value",
            )


@tensorclass
class NftUnits:
    """The update's units: one row per sample, with the schedule indices of the σs it trains at."""

    traj: Trajectory
    advantages: torch.Tensor  # [B]
    t_indices: torch.Tensor  # [B, K] long: indices into the rollout schedule's σs
    weight: torch.Tensor  # [B] 1, or 0 for a sample that only pads this worker's share


class Nft(ForwardProcess):
    rollout_policy = "old"

    @classmethod
    def trained_calls(cls, algorithm, sampling) -> int:
        return max(1, int(sampling.num_steps * algorithm.settings.timestep_fraction))

    @classmethod
    def frozen_calls(cls, algorithm, sampling, guidance_cost) -> int:
        # the `old` adapter's velocity; the reference's with a KL
        return 1 + super().frozen_calls(algorithm, sampling, guidance_cost)

    def attach(self, model) -> None:
        super().attach(model)
        model.policies.add("old")

    def begin(self, batch: TrainBatch, step: int) -> tuple[NftUnits, dict[str, float]]:
        steps, fraction = self.sampler.num_steps, self.settings.timestep_fraction
        traj = batch.traj
        indices = [
            nft_timestep_indices(steps, fraction, make_generator(self.seed, step, "nft_timesteps", int(i)))
            for i in traj.ids.sample_index
        ]
        t_indices = torch.stack(indices).to(traj.device) if indices else torch.zeros(0, 1, dtype=torch.long)
        weight = torch.ones(traj.batch_size[0], device=traj.device)
        units = NftUnits(traj=traj, advantages=batch.targets.advantages, t_indices=t_indices, weight=weight,
                         batch_size=traj.batch_size)  # fmt: skip
        return units, {}

    def chunks(self, units: NftUnits) -> int:
        return max(1, int(self.sampler.num_steps * self.settings.timestep_fraction))

    def loss(self, units: NftUnits, k: int, at: UpdatePosition) -> LossOutput:
        traj = units.traj
        t_B = self.sigmas[units.t_indices[:, k].cpu()].to(traj.device)
        x0 = traj.final_latents
        generators = [
            make_generator(self.seed, at.step, "nft_noise", at.epoch, int(i), k) for i in traj.ids.sample_index
        ]
        x_t = forward_noise(x0, noise_like(x0, generators), t_B)
        v = self.velocity(x_t, t_B, traj.cond)
        v_ref = self.velocity_of("reference", x_t, t_B, traj.cond) if self.settings.kl_beta > 0 else None
        inp = NftInput(
            v=v,
            v_old=self.velocity_of("old", x_t, t_B, traj.cond),
            v_ref=v_ref,
            x_t=x_t,
            x0=x0.float(),
            t=t_B,
            advantages=units.advantages,
            weights=units.weight,
        )
        return self.loss_fn(inp, self.settings)

    def end(self, step: int) -> dict[str, float]:
        completed, s = step + 1, self.settings
        if completed % s.old_update_interval:
            return {}
        fixed = s.old_decay_value if s.old_decay == "fixed" else None
        decay = old_decay(completed, s.old_decay, fixed)
        self.model.policies.ema_update("old", "default", decay)
        return {"nft/old_decay": decay}


@register_loss("nft", settings=NftSettings, algorithm=Nft)
def nft_loss(inp: NftInput, cfg) -> LossOutput:
    """cfg needs nft_beta, adv_clip_max, kl_beta, reward_mode and weight_floor."""
    beta, c, kl_beta = float(cfg.nft_beta), float(cfg.adv_clip_max), float(cfg.kl_beta)
    floor = float(cfg.weight_floor)
    if floor <= 0:
        raise ValueError(f"weight_floor must be > 0 (the loss divides by it); got {floor}")
    if beta <= 0:
        raise ValueError(f"nft_beta must be > 0 (the loss divides by it); got {beta}")
    if c <= 0:
        raise ValueError(f"adv_clip_max must be > 0 (r divides by it); got {c}")
    if kl_beta > 0 and inp.v_ref is None:
        raise ValueError("kl_beta > 0 needs v_ref (the reference policy's velocity); got None")

    # fp32: x0+ and x0- differ from each other by O(beta * t * |v - v_old|), far below bf16's resolution
    v, v_old = inp.v.float(), inp.v_old.detach().float()
    x_t, x0 = inp.x_t.float(), inp.x0.float()
    t_B1 = inp.t.float().view(-1, *([1] * (v.ndim - 1)))
    r_B = reward_probability(inp.advantages, c, cfg.reward_mode)

    x0_pos = x_t - t_B1 * (beta * v + (1 - beta) * v_old)
    x0_neg = x_t - t_B1 * ((1 + beta) * v_old - beta * v)
    with torch.no_grad():
        w_pos_B = row_mean((x0_pos - x0).abs()).clamp_min(floor)
        w_neg_B = row_mean((x0_neg - x0).abs()).clamp_min(floor)
    pos_B = row_mean((x0_pos - x0).pow(2)) / w_pos_B
    neg_B = row_mean((x0_neg - x0).pow(2)) / w_neg_B
    w = inp.weights
    policy = c * weighted((r_B * pos_B + (1 - r_B) * neg_B) / beta, w).mean()

    if inp.v_ref is not None:
        kl_B = row_mean((v - inp.v_ref.detach().float()).pow(2))
    else:
        kl_B = torch.zeros_like(r_B)
    loss = policy + kl_beta * weighted(kl_B, w).mean() if kl_beta > 0 else policy

    with torch.no_grad():
        metrics = {
            "nft/r_mean": metric_mean(r_B, w),
            "nft/policy_loss": policy,
            "nft/positive_loss": metric_mean(pos_B, w),
            "nft/negative_loss": metric_mean(neg_B, w),
            "kl_ref": metric_mean(kl_B, w),
            "nft/old_gap": metric_mean(row_mean((v - v_old).pow(2)), w),
        }
    return LossOutput(loss=loss, metrics=detached(metrics))
