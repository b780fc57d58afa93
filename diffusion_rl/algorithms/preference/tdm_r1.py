"""TDM-R1 (arXiv 2603.07700): RL for few-step generators with a non-differentiable reward, without a denoising loss.

Its authors' diagnosis of why RL blurs a distilled model is that a DSM (flow-matching) loss pulls a few-step generator
back towards a many-step one; their generator is trained by (a) maximising a surrogate of the reward at the noisy
states along its own deterministic trajectory and (b) a KL regularisation — no DSM term (Luo-Yihong/TDM-R1 issues
#3 and #5). What this file builds from those facts, with one trained network, is a reduced form of their published
code (three trained LoRA adapters; docs/direct_preference.md, "TDM-R1", lists the differences):

The rollout is deterministic and recorded step by step (sampling.sde_type=sde at noise_level 0: every step an Euler
step of the ODE, kept in the trajectory), so each state x_i of a sample's path leads to one final image and carries
that image's reward: a per-step reward, no noise estimate. For each group of G samples of a prompt and each step i
of the T steps (cfg: push = η, kl_beta = λ, ridge = ρ, adv_clip_max = c), with y_i the states after step i
(the final latents for i = T − 1), flattened to D numbers:

    a_j   = clamp(A_j, −c, c) − mean_k clamp(A_k, −c, c)            centered advantages [G]
    Y_j   = y_i,j − mean_k y_i,k                                    centered next states [G, D], detached
    b     = Yᵀ (Y Yᵀ + ρ·tr(Y Yᵀ)/G · I)⁻¹ a                         the group's surrogate: the least-norm (ridge)
                                                                     linear fit of the advantages on the next states
    d     = −b / rms(b)   (0 when b = 0: a group whose rewards tie)  ascent direction of the velocity: the Euler step
                                                                     y = x + (σ_{i+1} − σ_i)·v moves y by +|Δσ|·b
    δ_j   = v_θ(x_i,j, σ_i) − v_ref(x_i,j, σ_i)                      v_ref: the frozen start, no gradient
    loss  = mean over groups and rows of  λ/2 · mean_D δ_j²  −  η · mean_D (d · δ_j)

whose minimiser is δ = (η/λ)·d: the step of the frozen start, tilted along the surrogate's ascent. With λ = 0 the
anchor is the policy's own detached velocity (the push alone). The surrogate is fitted afresh for each group and
step from the rollout's own states, not learned: the authors learn a diffusion model p_φ as the surrogate and
regularise the marginal KL through a fake-score network s_ψ, two more trained networks (see the docs' deviations).

Metrics: tdm_r1/policy_loss, tdm_r1/push (mean d·δ), tdm_r1/tied_groups (the fraction with d = 0), kl_ref (mean δ²,
0 without a reference).

The update (`TdmR1`): the unit is a whole group (`GroupProcess`); K = sampling.num_steps chunks, one per step of the
rollout, one backward pass each.
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
    metric_mean,
    weighted,
)
from diffusion_rl.config.fields import Range, check, opt


@dataclass
class TdmR1Input:
    """One micro-batch of U groups of G rows each, at one step of their rollouts."""

    v: torch.Tensor  # [U, G, ...] policy velocity at the step's states, with grad
    next_states: torch.Tensor  # [U, G, ...] the rollout's states after the step (no grad)
    advantages: torch.Tensor  # [U, G] each row's group-relative advantage
    v_ref: torch.Tensor | None = None  # [U, G, ...] the frozen start's velocity there; needed if kl_beta > 0
    weights: torch.Tensor | None = None  # [U] per group (0: a group that only pads a worker's share); None: all 1

    def __post_init__(self):
        check_groups(self.v, self.advantages, self.weights, next_states=self.next_states, v_ref=self.v_ref)


@dataclass
class TdmR1Settings(LossSettings):
    push: float = opt(
        1.0, "η: the weight of the surrogate's ascent direction (unit RMS) in the loss; η/kl_beta is the velocity "
        "shift, per element, the KL holds the policy at.", within=Range(0, 1e3, lo_open=True),
    )  # fmt: skip
    kl_beta: float = opt(0.01, "λ: weight of ½·mean (v_θ − v_ref)² at the trajectory's states.", within=Range(0, 1e4))
    ridge: float = opt(
        0.1, "ρ: the surrogate's ridge, relative to the mean squared norm of the group's centered next states.",
        within=Range(0, 1e6, lo_open=True),
    )  # fmt: skip
    adv_clip_max: float = opt(5.0, "Advantages are clamped to ±this.", within=Range(0, 1000, lo_open=True))


def surrogate_direction(next_states: torch.Tensor, advantages: torch.Tensor, ridge: float, c: float) -> torch.Tensor:
    """[U, G, ...], [U, G] → d [U, D] fp32: −b/rms(b) of the ridge least-norm linear fit b of the centered, clamped
    advantages on the centered next states (0 where b = 0). fp64: a G×G solve of near-parallel states."""
    Y = next_states.detach().flatten(2).double()
    Y = Y - Y.mean(dim=1, keepdim=True)
    a = advantages.detach().double().clamp(-c, c)
    a = a - a.mean(dim=1, keepdim=True)
    gram = Y @ Y.transpose(1, 2)  # [U, G, G]
    G = gram.shape[-1]
    scale = ridge * gram.diagonal(dim1=1, dim2=2).mean(dim=1).clamp_min(1e-30)  # [U]
    coef = torch.linalg.solve(gram + scale[:, None, None] * torch.eye(G, dtype=gram.dtype, device=gram.device), a)
    b = (coef.unsqueeze(2) * Y).sum(dim=1)  # [U, D]
    rms = b.pow(2).mean(dim=1, keepdim=True).sqrt()
    return torch.where(rms > 0, -b / rms.clamp_min(1e-300), torch.zeros_like(b)).float()


class TdmR1(GroupProcess):
    @classmethod
    def check_rollout(cls, algorithm, sampling) -> None:
        check(
            sampling.sde_type == "sde" and sampling.noise_level == 0,
            "algorithm.loss=tdm_r1 trains on the states of a deterministic rollout, recorded step by step: set "
            f"sampling.sde_type=sde and sampling.noise_level=0 (got {sampling.sde_type}, {sampling.noise_level:g})",
        )

    @classmethod
    def trained_calls(cls, algorithm, sampling) -> int:
        return sampling.num_steps

    def chunks(self, units: GroupUnits) -> int:
        return self.sampler.num_steps

    def loss(self, units: GroupUnits, k: int, at: UpdatePosition) -> LossOutput:
        s = self.settings
        U, G = units.advantages.shape
        traj = units.traj.reshape(U * G)
        T = self.sampler.num_steps
        if traj.latents is None or traj.latents.shape[1] != T:
            got = None if traj.latents is None else traj.latents.shape[1]
            raise ValueError(f"tdm_r1 needs the states before each of the {T} steps (window.kind=all); got {got}")
        x = traj.latents[:, k].float()
        y = traj.latents[:, k + 1].float() if k + 1 < T else traj.final_latents.float()
        t_N = self.sigmas[k].expand(U * G).to(traj.device)
        cond = traj.cond
        # the frozen forward first: it then never coincides with the trained forward's activations
        v_ref = self.reference_velocity(x, t_N, cond, None) if s.kl_beta > 0 else None
        v = self.velocity(x, t_N, cond)
        shape = (U, G, *x.shape[1:])
        inp = TdmR1Input(
            v=v.view(shape),
            next_states=y.view(shape),
            advantages=units.advantages,
            v_ref=None if v_ref is None else v_ref.view(shape),
            weights=units.weight,
        )
        return self.loss_fn(inp, s)


@register_loss("tdm_r1", settings=TdmR1Settings, algorithm=TdmR1)
def tdm_r1_loss(inp: TdmR1Input, cfg) -> LossOutput:
    """cfg needs push, kl_beta, ridge and adv_clip_max."""
    eta, lam = float(cfg.push), float(cfg.kl_beta)
    if lam > 0 and inp.v_ref is None:
        raise ValueError("tdm_r1 with kl_beta > 0 needs v_ref (the frozen start's velocity); got None")
    U, G = inp.advantages.shape
    d_U1D = surrogate_direction(inp.next_states, inp.advantages, float(cfg.ridge), float(cfg.adv_clip_max))[:, None]
    v = inp.v.float().flatten(2)
    anchor = v.detach() if inp.v_ref is None else inp.v_ref.detach().float().flatten(2)
    delta = v - anchor  # [U, G, D]
    kl_UG = delta.pow(2).mean(dim=2)
    push_UG = (d_U1D * delta).mean(dim=2)
    w = inp.weights
    loss = weighted((lam / 2 * kl_UG - eta * push_UG).mean(dim=1), w).mean()

    with torch.no_grad():
        metrics = {
            "tdm_r1/policy_loss": loss,
            "tdm_r1/push": metric_mean(push_UG.mean(dim=1), w),
            "tdm_r1/tied_groups": metric_mean((d_U1D.abs().amax(dim=(1, 2)) == 0).float(), w),
            "kl_ref": metric_mean(kl_UG.mean(dim=1), w) if inp.v_ref is not None else torch.zeros(()),
        }
    return LossOutput(loss=loss, metrics=detached(metrics))
