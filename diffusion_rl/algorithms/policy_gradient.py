"""The policy-gradient algorithm (Flow-GRPO, GRPO-Guard, Flow-DPPO, and any loss registered with it).

For every trained window step j of every sample: recompute log π_θ(x_{j+1} | x_j) and the step mean with the
rollout's guided velocity and step type, and hand them, with the rollout's (or recomputed old) values, to the
registered loss. Which of the window's W steps train: the first K = max(1, int(W · timestep_fraction)), or a
seeded per-sample subset of K (`timestep_selection: random`). The update loop scales each chunk so that an
optimizer step sees the mean over (kept samples × trained steps) of its mini-batch, whatever the micro-batch size.

Advantages are per trained step ([B, K] in the units): a flat row's one advantage on each of its steps; with tree
rollouts (`sampling.tree`) the advantage of the node each step leads into, times the step's weight (its share among
the rows that hold the same transition, 0 where pruned). Both come from the algorithm's credit (algorithms/credit.py,
algorithms/tree_credit.py), and the PPO anchor from its rollout correction, when it has one: collaborators chosen
when the algorithm is built, so the plain step walks past neither's options.

Rollout correction (algorithm.rollout_correction): `decoupled` recomputes the old log-probs and means with the
weights before the update and weights each entry by π_old / π_rollout (algorithms/rollout_correction.py);
`bypass` keeps the rollout's as the PPO anchor and, with a rejection statistic, drops entries whose current
log-prob is too far from the rollout's.

What every policy-gradient loss shares is here too: a loss is `fn(inp: PolicyLossInput, settings) -> LossOutput`,
registered with `register_loss(..., algorithm=PolicyGradient)` in a file of its own under algorithms/losses/;
`settings` is its dataclass (a `PolicyLossSettings`; any object with those attributes works, e.g. a SimpleNamespace in
a test), and the KL term, PPO's clipped surrogate, the ratio metrics and the loss's end are written once below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import tensorclass

from diffusion_rl.algorithms.base import (
    Algorithm,
    LossOutput,
    LossSettings,
    TrainBatch,
    UpdatePosition,
    loss_names,
)
from diffusion_rl.algorithms.rollout_correction import Anchor, make_correction, recomputed_forwards
from diffusion_rl.algorithms.tree_credit import TreeCredit
from diffusion_rl.config.fields import Range, check, opt
from diffusion_rl.config.plugins import STEP_TYPES
from diffusion_rl.metrics import MAX, MIN, declare_metrics
from diffusion_rl.sampling.rollout import recompute_step
from diffusion_rl.sampling.trajectory import Trajectory
from diffusion_rl.utils.seeding import make_generator


@dataclass
class PolicyLossInput:
    """One training micro-batch at one denoising step; B = samples in the micro-batch. Built in one place
    (`PolicyGradient.loss`), whose shapes the algorithm's tests hold: no checks on the hot path."""

    log_prob: torch.Tensor  # [B] current policy's log-prob of the rollout's next latent, with grad
    old_log_prob: torch.Tensor  # [B] the same under the rollout (or recomputed old) policy, no grad
    advantages: torch.Tensor  # [B]
    mean: torch.Tensor  # [B, ...] current policy's SDE step mean, with grad
    old_mean: torch.Tensor  # [B, ...] rollout policy's step mean, no grad
    ref_mean: torch.Tensor | None  # [B, ...] reference policy's step mean, no grad; None when KL is off
    std: torch.Tensor  # [B] the step's std as its type reports it: `sde`'s std_dev_t WITHOUT sqrt(dt), else noise std
    sqrt_dt: torch.Tensor  # [B] sqrt(|dt|) of the step: for `sde` the noise std is std * sqrt_dt
    weights: torch.Tensor | None = None  # [B] rollout-correction weights (detached), multiply the per-sample loss
    kl_weights: torch.Tensor | None = None  # [B] weights of a loss's KL term alone (GARDO's gate); None: the loss's own


@dataclass
class PolicyLossSettings(LossSettings):
    """Settings every policy-gradient loss has; a loss's own settings subclass this."""

    kl_beta: float = opt(
        0.0, "Weight of the KL to the reference policy's step (0 = off: no reference forward).", within=Range(0, 1e4)
    )


@dataclass
class ClippedLossSettings(PolicyLossSettings):
    """Settings of a PPO-clip loss (the clip range's default is Flow-GRPO's; a loss may set its own)."""

    clip_range: float = opt(1e-4, "PPO ratio clip range (Flow-GRPO's 1e-4).", within=Range(0, 100, lo_open=True))
    adv_clip_max: float = opt(
        5.0, "Advantages are clamped to ±this inside the loss.", within=Range(0, 1000, lo_open=True)
    )


def require_exact_anchor_means(sampling, loss: str, use: str) -> None:
    """For a loss that reads the rollout's stored step means (`old_mean`) at the scale of the step's noise: bf16
    storage (sampling.latents_dtype) rounds them by ~2⁻⁹ of their size, which on-policy already moves `use` by
    about its threshold (measured on the tiny model); fp16's 2⁻¹² stays ~1 % of it."""
    check(
        sampling.latents_dtype != "bf16",
        f"algorithm.loss={loss} reads the rollout's stored step means ({use}): sampling.latents_dtype=bf16 rounds "
        "them enough to move it on-policy; use sampling.latents_dtype=fp16 (or fp32)",
    )


def kl_to_reference(inp: PolicyLossInput, kl_beta: float) -> torch.Tensor:
    """[B]: the KL term of every policy-gradient loss, 0 when kl_beta is 0 (no reference forward needed).

        kl_i = mean over the non-batch dims of (mean_i - ref_mean_i)^2 / (2 * std_i^2)

    std_i is the step's std as its step type reports it. For the `sde` step that is std_dev_t, without √dt (the
    noise variance is std_dev_t^2 * dt), as Flow-GRPO does: kl_i is the per-element Gaussian KL between the two
    step distributions times dt (= sigma - sigma_next), so Flow-GRPO's kl_beta values carry over. For `sde_linear`,
    `cps` and `dance_sde` std already is the step's noise std, and kl_i is the per-element KL itself (for
    `sde_linear` flow_grpo's Wan KL, train_wan2_1.py's (std_dev_t·√dt)² denominator; for `cps`, whose
    log-prob has no Gaussian scale, the KL of the Gaussians with that std). With inp.kl_weights, kl_i times them.
    """
    if kl_beta <= 0:
        return torch.zeros_like(inp.log_prob, dtype=torch.float32)
    if inp.ref_mean is None:
        raise ValueError("kl_beta > 0 needs ref_mean (the reference policy's step mean); got None")
    # fp32: the mean difference is small next to the means; bf16 would round most of it away
    kl_B = (inp.mean.float() - inp.ref_mean.float()).pow(2).flatten(1).mean(dim=1) / (2 * inp.std.float() ** 2)
    return kl_B if inp.kl_weights is None else kl_B * inp.kl_weights.detach().float()


def clipped_surrogate(adv_B: torch.Tensor, ratio_B: torch.Tensor, clip_range: float) -> torch.Tensor:
    """[B] PPO's pessimistic surrogate: max(-A · ratio, -A · clamp(ratio, 1 - clip_range, 1 + clip_range))."""
    return torch.maximum(-adv_B * ratio_B, -adv_B * ratio_B.clamp(1.0 - clip_range, 1.0 + clip_range))


def policy_loss_output(
    inp: PolicyLossInput, policy_B: torch.Tensor, kl_B: torch.Tensor, kl_beta: float, **metrics: torch.Tensor
) -> LossOutput:
    """The end every policy-gradient loss shares: loss = mean_i of weight_i · (policy_i + kl_beta · kl_i) (weight_i
    = 1 when inp.weights is None; the KL term only when kl_beta > 0), with the metrics policy_loss and kl_ref (row
    means) before the loss's own `metrics`, all detached."""
    per_sample_B = policy_B + kl_beta * kl_B if kl_beta > 0 else policy_B
    if inp.weights is not None:
        per_sample_B = per_sample_B * inp.weights.detach().float()
    out = {"policy_loss": policy_B.mean(), "kl_ref": kl_B.mean(), **metrics}
    return LossOutput(loss=per_sample_B.mean(), metrics={k: v.detach() for k, v in out.items()})


@torch.no_grad()
def ratio_metrics(log_ratio_B: torch.Tensor, ratio_B: torch.Tensor,
                  clip_range: float | None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The likelihood-ratio metrics every policy-gradient loss logs, over the micro-batch's rows (unweighted):
    ppo_kl = mean(−log_ratio) (verl-omni's: an estimate of KL(π_old ‖ π_θ)), approx_kl = mean(log_ratio²) / 2,
    ratio_mean, ratio_std (ddof 0), ratio_min, ratio_max; with a clip_range (None: the loss has none) clip_fraction =
    mean(|ratio − 1| > clip_range), _higher: mean(ratio − 1 > clip_range), _lower: mean(1 − ratio > clip_range).
    log_ratio_B = log π_θ − log π_old of the step; ratio_B the ratio the loss clips (GRPO-Guard's rescaled one)."""
    lr_B, r_B = log_ratio_B.detach().float(), ratio_B.detach().float()
    out = {"ppo_kl": (-lr_B).mean(), "approx_kl": 0.5 * (lr_B**2).mean(), "ratio_mean": r_B.mean(),
           "ratio_std": r_B.std(correction=0), "ratio_min": r_B.min(), "ratio_max": r_B.max()}  # fmt: skip
    if clip_range is not None:  # |ratio − 1| > clip_range is one side or the other
        higher, lower = r_B - 1.0 > clip_range, 1.0 - r_B > clip_range
        out.update(clip_fraction=(higher | lower).float().mean(), clip_fraction_higher=higher.float().mean(),
                   clip_fraction_lower=lower.float().mean())  # fmt: skip
    return out


declare_metrics({"ratio_min": MIN, "ratio_max": MAX, "train/logp_diff_max": MAX})


@tensorclass
class PolicyGradientUnits:
    """The update's rows: one per sample, with the K window columns it trains and their anchors."""

    traj: Trajectory
    advantages: torch.Tensor  # [B, K]: each trained step's advantage (flat rows: the row's, K times)
    weight: torch.Tensor  # [B] 1, or 0 out of the loss (drop_zero_advantage's A = 0, or padding a worker's share)
    columns: torch.Tensor  # [B, K] long: the window columns trained, in order
    step_weight: torch.Tensor  # [B, K]: 1 (flat), or a tree step's share among the rows that hold it, pruning's 0
    old_log_probs: torch.Tensor  # [B, K]: the PPO anchor (rollout's, or recomputed with decoupled correction)
    old_means: torch.Tensor  # [B, K, …]: the anchor's step means
    correction: torch.Tensor  # [B, K]: rollout-correction weights (1 without decoupled correction)
    sqrt_dt: torch.Tensor  # [B, K]: sqrt(σ_j − σ_{j+1}) of each trained step


def trained_step_count(window: int, fraction: float) -> int:
    """K = max(1, int(W · fraction)): the window steps each sample trains (truncated, as flow_grpo's
    `int(num_train_timesteps * timestep_fraction)`)."""
    return max(1, int(window * fraction))


def trained_columns(sample_index: torch.Tensor, window: int, fraction: float, selection: str, seed: int, step: int):
    """[B, K] window columns each sample trains on at step `step`: the first K, or a seeded per-sample subset."""
    B, K = len(sample_index), trained_step_count(window, fraction)
    if selection == "first":
        return torch.arange(K).expand(B, K)
    return torch.stack([torch.randperm(window, generator=make_generator(seed, step, "timesteps", i))[:K]
                        for i in sample_index.tolist()])  # fmt: skip


def gather_columns(values_BW: torch.Tensor, columns_BK: torch.Tensor) -> torch.Tensor:
    """values[b, columns[b, k]] → [B, K, …]."""
    rows = torch.arange(values_BW.shape[0], device=values_BW.device)[:, None]
    return values_BW[rows, columns_BK]


class PolicyGradient(Algorithm):
    family = "policy_gradient"

    @classmethod
    def check_config(cls, algorithm, sampling, sample_source) -> None:
        check(
            sampling.sde_type != "ode",
            "sampling.sde_type=ode has no per-step log-probs for a policy-gradient loss; use one of "
            f"{', '.join(n for n in STEP_TYPES.names() if n != 'ode')} (or a direct-preference loss: "
            f"{loss_names(family='direct_preference')})",
        )
        check(
            sample_source == "online",
            f"data.sample_source=offline trains algorithm.loss={loss_names(offline=True)} only (offline pairs have no "
            "per-step log-probs)",
        )

    @classmethod
    def trained_calls(cls, algorithm, sampling) -> int:
        """K = max(1, int(W · timestep_fraction)) of the window's W stochastic steps (module docstring)."""
        w = sampling.window
        return trained_step_count(sampling.num_steps - 1 if w.kind == "all" else w.size, algorithm.timestep_fraction)

    @classmethod
    def calls_before_update(cls, algorithm, sampling) -> int:
        """The decoupled correction's old log-probs: every trained step recomputed once, before the epochs."""
        return cls.trained_calls(algorithm, sampling) * recomputed_forwards(algorithm.rollout_correction)

    def __init__(self, section, spec, **context):
        super().__init__(section, spec, **context)
        if self.sampler.tree is not None:  # tree rollouts: per-depth credit in place of flat
            self.credit = TreeCredit(self.sampler.tree, self.tree_prune, section.advantage)
        self.correction = make_correction(section.rollout_correction)  # None: the rollout is the anchor
        self.kl_beta = self.settings.kl_beta

    def begin(self, batch: TrainBatch, step: int) -> tuple[PolicyGradientUnits, dict[str, float]]:
        alg, traj = self.section, batch.traj
        columns = trained_columns(traj.ids.sample_index, traj.window_size, alg.timestep_fraction,
                                  alg.timestep_selection, self.seed, step).to(traj.device)  # fmt: skip
        advantages, step_weight = self.credit.per_step(batch.targets, traj, columns)
        weight = (advantages != 0).any(1).float() if alg.drop_zero_advantage else torch.ones_like(advantages[:, 0])
        log_probs, means = gather_columns(traj.log_probs, columns), gather_columns(traj.means, columns).float()
        anchor = Anchor(log_probs, means, torch.ones_like(log_probs), {})  # the rollout's
        if self.correction is not None:
            anchor = self.correction.anchor(anchor, lambda: self._old_policy(traj, columns))
        sqrt_dt = (gather_columns(traj.sigmas, columns) - gather_columns(traj.sigmas_next, columns)).sqrt()
        units = PolicyGradientUnits(traj=traj, advantages=advantages, weight=weight, columns=columns,
                                    step_weight=step_weight, old_log_probs=anchor.log_probs, old_means=anchor.means,
                                    correction=anchor.weights, sqrt_dt=sqrt_dt, batch_size=traj.batch_size)  # fmt: skip
        return units, {"train/kept_fraction": float(weight.mean()), **anchor.metrics}

    def chunks(self, units: PolicyGradientUnits) -> int:
        return units.columns.shape[1]  # K trained steps, one backward pass each

    def loss(self, units: PolicyGradientUnits, k: int, at: UpdatePosition) -> LossOutput:
        # the reference's first, so the trained forward's activations are not held meanwhile (the device peak, which
        # model.offload_reference's copy, on the device for this forward only, then stays out of)
        ref_mean = self._reference_mean(units, k) if self.kl_beta > 0 else None
        step = self._recompute(units.traj, units.columns[:, k])
        weights, rejection = units.weight * units.correction[:, k] * units.step_weight[:, k], {}
        if self.correction is not None:
            weights, rejection = self.correction.reject(step.log_prob, units.old_log_probs[:, k : k + 1], weights)
        sqrt_dt = units.sqrt_dt[:, k].contiguous()  # a strided view would sum (grpo_guard's mean) in another order
        inp = PolicyLossInput(log_prob=step.log_prob, old_log_prob=units.old_log_probs[:, k], mean=step.mean,
                              old_mean=units.old_means[:, k], ref_mean=ref_mean, advantages=units.advantages[:, k],
                              std=step.std, sqrt_dt=sqrt_dt, weights=weights)  # fmt: skip
        out = self.loss_fn(inp, self.settings)
        metrics = {**out.metrics, **rejection}
        if at.epoch == 0 and at.minibatch == 0:  # before the first optimizer step: 0 when the recompute replays the
            # rollout bit for bit (same weights, kernels, batch); rollouts sampled ahead or by an actor add their lag
            rollout_B = gather_columns(units.traj.log_probs, units.columns[:, k : k + 1])[:, 0]
            metrics["train/logp_diff_max"] = (step.log_prob.detach() - rollout_B).abs().max()
        return LossOutput(out.loss, metrics)

    # -- helpers ------------------------------------------------------------------------------------------------
    def _reference_mean(self, units: PolicyGradientUnits, k: int) -> torch.Tensor:
        """The reference policy's step means [B, …] at the units' k-th trained step, no grad (the KL's)."""
        with torch.no_grad(), self.model.reference():
            return self._recompute(units.traj, units.columns[:, k]).mean

    def _recompute(self, traj: Trajectory, cols_B: torch.Tensor):
        """The recorded step x_j → x_{j+1} (σ_j → σ_{j+1}) of window column cols_B[b] of each row b, under the active
        policy (sampling/rollout.py `recompute_step`)."""
        rows = torch.arange(traj.batch_size[0], device=cols_B.device)
        x, x_next, sigma, sigma_next = (traj.latents[rows, cols_B], traj.latents[rows, cols_B + 1],
                                        traj.sigmas[rows, cols_B], traj.sigmas_next[rows, cols_B])  # fmt: skip
        return recompute_step(self.model, x, x_next, sigma, sigma_next, traj.cond, self.sampler)

    @torch.no_grad()
    def _old_policy(self, traj: Trajectory, columns_BK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs [B, K] and means [B, K, …] of the trained steps under the weights before this update."""
        logps, means = [], []
        for micro in torch.arange(traj.batch_size[0], device=traj.device).split(self.micro_size):
            rows, cols = traj[micro], columns_BK[micro]
            steps = [self._recompute(rows, cols[:, k]) for k in range(cols.shape[1])]
            logps.append(torch.stack([s.log_prob for s in steps], dim=1))
            means.append(torch.stack([s.mean for s in steps], dim=1))
        return torch.cat(logps), torch.cat(means)
