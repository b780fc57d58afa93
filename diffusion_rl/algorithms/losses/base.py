"""What every policy-gradient loss shares: its input, the base of its settings, and the KL-to-reference term.

A policy-gradient loss is `fn(inp: PolicyLossInput, settings) -> LossOutput`, registered with `register_loss(...,
algorithm=PolicyGradient)` in a file of its own; `settings` is its dataclass (any object with those attributes
works, e.g. a SimpleNamespace in a test). The update (algorithms/policy_gradient.py) builds the input.
"""

from dataclasses import dataclass

import torch

from diffusion_rl.algorithms.base import LossOutput, LossSettings
from diffusion_rl.settings import Range, check, opt

__all__ = [
    "ClippedLossSettings",
    "LossOutput",
    "PolicyLossInput",
    "PolicyLossSettings",
    "kl_to_reference",
    "ratio_metrics",
    "require_exact_anchor_means",
]


@dataclass
class PolicyLossInput:
    """One training micro-batch at one denoising step; B = samples in the micro-batch."""

    log_prob: torch.Tensor  # [B] current policy's log-prob of the rollout's next latent, with grad
    old_log_prob: torch.Tensor  # [B] the same under the rollout (or recomputed old) policy, no grad
    advantages: torch.Tensor  # [B]
    mean: torch.Tensor  # [B, ...] current policy's SDE step mean, with grad
    old_mean: torch.Tensor  # [B, ...] rollout policy's step mean, no grad
    ref_mean: torch.Tensor | None  # [B, ...] reference policy's step mean, no grad; None when KL is off
    std: torch.Tensor  # [B] the step's std_dev_t, WITHOUT sqrt(dt)
    sqrt_dt: torch.Tensor  # [B] sqrt(|dt|) of the step: the noise std is std * sqrt_dt
    weights: torch.Tensor | None = None  # [B] rollout-correction weights (detached), multiply the per-sample loss

    def __post_init__(self):
        batch = self.log_prob.shape
        if len(batch) != 1:
            raise ValueError(f"log_prob must be [B]; got {tuple(batch)}")
        for name in ("old_log_prob", "advantages", "std", "sqrt_dt", "weights"):
            value = getattr(self, name)
            if value is not None and value.shape != batch:
                raise ValueError(f"{name} must be [B] = {tuple(batch)}; got {tuple(value.shape)}")
        for name in ("mean", "old_mean", "ref_mean"):
            value = getattr(self, name)
            if value is not None and (value.ndim < 1 or value.shape[0] != batch[0]):
                raise ValueError(f"{name} must be [B, ...] with B = {batch[0]}; got {tuple(value.shape)}")
        if self.ref_mean is not None and self.ref_mean.shape != self.mean.shape:
            raise ValueError(f"ref_mean {tuple(self.ref_mean.shape)} must have mean's shape {tuple(self.mean.shape)}")


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
    step distributions times dt (= sigma - sigma_next), so Flow-GRPO's kl_beta values carry over. For `cps` and
    `dance_sde` std already is the step's noise std, and kl_i is the per-element KL itself (for `cps`, whose
    log-prob has no Gaussian scale, the KL of the Gaussians with that std).
    """
    if kl_beta <= 0:
        return torch.zeros_like(inp.log_prob, dtype=torch.float32)
    if inp.ref_mean is None:
        raise ValueError("kl_beta > 0 needs ref_mean (the reference policy's step mean); got None")
    # fp32: the mean difference is small next to the means; bf16 would round most of it away
    sq_diff_B = (inp.mean.float() - inp.ref_mean.float()).pow(2).flatten(1).mean(dim=1)
    return sq_diff_B / (2 * inp.std.float() ** 2)


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
def ratio_metrics(
    log_ratio_B: torch.Tensor, ratio_B: torch.Tensor, clip_range: float | None
) -> dict[str, torch.Tensor]:
    """The likelihood-ratio metrics every policy-gradient loss logs, over the micro-batch's rows (unweighted):

        ppo_kl      = mean(-log_ratio)                 (verl-omni's ppo_kl: an estimate of KL(π_old ‖ π_θ))
        approx_kl   = mean(log_ratio^2) / 2
        ratio_mean, ratio_std (population std, ddof 0), ratio_min, ratio_max      of ratio
        clip_fraction = mean(|ratio - 1| > clip_range)
        clip_fraction_higher = mean(ratio - 1 > clip_range),  clip_fraction_lower = mean(1 - ratio > clip_range)

    log_ratio_B is log π_θ - log π_old of the step (before any rescaling); ratio_B the ratio the loss clips (for
    GRPO-Guard its re-centred, rescaled one). clip_range None (a loss without a ratio clip): no clip fractions.
    """
    log_ratio_B, ratio_B = log_ratio_B.detach().float(), ratio_B.detach().float()
    out = {
        "ppo_kl": (-log_ratio_B).mean(),
        "approx_kl": 0.5 * (log_ratio_B**2).mean(),
        "ratio_mean": ratio_B.mean(),
        "ratio_std": ratio_B.std(correction=0),
        "ratio_min": ratio_B.min(),
        "ratio_max": ratio_B.max(),
    }
    if clip_range is not None:
        out["clip_fraction"] = ((ratio_B - 1.0).abs() > clip_range).float().mean()
        out["clip_fraction_higher"] = (ratio_B - 1.0 > clip_range).float().mean()
        out["clip_fraction_lower"] = (1.0 - ratio_B > clip_range).float().mean()
    return out
