"""Rollout correction: per-step loss weights for rollouts whose policy differs from the one being trained.

The rollout's log-probs come from the sampler (another engine, another precision, or weights a few updates
old), so the rollout policy π_rollout may differ from the training policy. Shapes are [B, W]: B samples, W
trained steps of the window; column j of the weights multiplies step j's per-sample loss (`PolicyLossInput.
weights`). Weights are detached; a zero weight leaves the row in the mean's denominator.

Two modes (what the caller passes as `logp_old_BW`):

- bypass (default): the PPO anchor is the rollout's log-prob, so the loss's ratio π_θ / π_rollout already
  carries the importance weight; no IS weight is applied (is_kind, threshold, icepop_* are unused). Only the
  rejection mask applies, if rs_stat is set; it is computed from the CURRENT policy's log-probs of the same
  steps (detached), passed as `logp_old_BW`, against the rollout's. rs_level sum/mean/max need all W
  steps' current log-probs before any of them is weighted; a caller that forwards one step at a time can use
  rs_level step (on [B, 1] tensors) instead.
- decoupled: the caller recomputes the old log-probs with the current weights before the update and passes
  them as `logp_old_BW`; they are the PPO anchor, and w = π_old / π_rollout corrects for the rollout policy:
      log w = clamp(logp_old - logp_rollout, ±20)                              level: step
      log w = clamp(sum over the window of (logp_old - logp_rollout), ±20)    level: sequence, every column
      tis: w = min(w, threshold);  icepop: w if icepop_lo ≤ w ≤ icepop_hi else 0;  none: w = 1
      is_batch_normalize: w = w / mean(w), the mean over the [B, W] entries this call sees (at level sequence
      every column of a row holds the same w, so that is the mean over samples); skipped when mean(w) ≤ 1e-8

Rejection (either mode), from the per-step log w = clamp(logp_old - logp_rollout, ±20):
    k1 = -log w, kept when log lo ≤ k1 ≤ log hi (i.e. w in [1/hi, 1/lo]); rs_bound h alone means [1/h, h]
    k2 = (log w)^2 / 2 ≤ rs_bound;   k3 = w - 1 - log w ≤ rs_bound
rs_level step rejects single steps; sum / mean / max reduce the statistic over the window first and reject
the whole sample (every column). max of k1 is refused: a signed statistic's max bounds only one side.
Criteria chain: rs_stat/rs_bound/rs_level is the first criterion, each entry of rs_chain ({stat, bound, level})
another; an entry is kept only when it passes every criterion. The loss weight is (normalised) IS weight × keep.

Which of these a run uses is one collaborator chosen when the algorithm is built (`make_correction`): the PPO anchor
and its weights (`anchor`, before the update) and the per-step rejection (`reject`, inside the loss). The plain path,
bypass without rejection, has none: the rollout's log-probs and means are the anchor, every weight 1.

Off-policy diagnostics, from l = logp_old - logp_rollout [B, W] (unclamped where finite; exponentials of the
clamped l, and of the clamped row sum for the sequence form):
    kl = mean(-l)                          estimates KL(π_rollout ‖ π_old) on the rollout's samples
    k3_kl = mean(exp(l) - 1 - l)           the k3 estimator of the same KL (≥ 0 entry by entry)
    ppl_ratio = mean_b exp(-mean_w l)      per sample, exp(mean log-prob) of rollout over old: the perplexity ratio
    chi2_step = mean(exp(2 l)) - 1         χ²(π_old ‖ π_rollout) per step: the variance of the step IS weights
    chi2_seq = mean_b exp(2 sum_w l) - 1   the same for the product of a sample's step weights
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diffusion_rl.config.rollout_correction import RejectionCriterion, RolloutCorrectionConfig
from diffusion_rl.metrics import MAX, ROWS, declare_metrics, rule_of

SAFETY_BOUND = 20.0  # |log w| cap: exp(20) ≈ 4.9e8 stays finite in fp32, and so does its square
# bypass rejection reports these per trained step, as shares of the step's entries: weighted by the rows of each pass
declare_metrics({"rollout_corr/abs_dlogp_max": MAX, "rollout_corr/rejected_fraction": ROWS, "rollout_corr/kl": ROWS,
                 "rollout_corr/k3_kl": ROWS, "rollout_corr/chi2_step": ROWS,
                 "rollout_corr/rejected_fraction/*": ROWS})  # fmt: skip


@dataclass
class CorrectionResult:
    weights_BW: torch.Tensor  # float32 [B, W], detached: IS weight × rejection mask
    metrics: dict[str, torch.Tensor]  # scalar tensors, detached


def _criterion_keep(log_w_BW: torch.Tensor, c: RejectionCriterion) -> torch.Tensor:
    """Bool [B, W], True = kept by criterion c; log_w is already clamped, fp32."""
    if c.stat == "k1":
        stat = -log_w_BW
    elif c.stat == "k2":
        stat = 0.5 * log_w_BW**2
    else:
        stat = torch.exp(log_w_BW) - 1 - log_w_BW
    if c.level == "sum":
        stat = stat.sum(dim=1, keepdim=True)
    elif c.level == "mean":
        stat = stat.mean(dim=1, keepdim=True)
    elif c.level == "max":
        stat = stat.amax(dim=1, keepdim=True)
    if c.stat == "k1":
        lo, hi = c.bound
        keep = (stat >= math.log(lo)) & (stat <= math.log(hi))
    else:
        keep = stat <= c.bound
    return keep.expand_as(log_w_BW)


def rejection_masks(log_w_BW: torch.Tensor, cfg: RolloutCorrectionConfig) -> list[tuple[str, torch.Tensor]]:
    """(criterion name, bool [B, W] kept by it) for each criterion of the chain, in order."""
    log_w = log_w_BW.float().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return [(c.name, _criterion_keep(log_w, c)) for c in cfg.criteria]


def offpolicy_metrics(log_w_BW: torch.Tensor, sequence: bool = True) -> dict[str, torch.Tensor]:
    """rollout_corr/{kl, k3_kl, chi2_step} and, with `sequence` (all of a sample's trained steps in the row),
    {ppl_ratio, chi2_seq}: see the module docstring. log_w = logp_old - logp_rollout [B, W], finite."""
    log_w = log_w_BW.detach().double()  # fp64: exp(2 l) of a clamped l reaches e^40
    safe = log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out = {
        "rollout_corr/kl": (-log_w).mean(),
        "rollout_corr/k3_kl": (torch.exp(safe) - 1 - safe).mean(),
        "rollout_corr/chi2_step": torch.exp(2 * safe).mean() - 1,
    }
    if sequence:
        row_sum = log_w.sum(dim=1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        out["rollout_corr/ppl_ratio"] = torch.exp((-log_w.mean(dim=1)).clamp(max=SAFETY_BOUND)).mean()
        out["rollout_corr/chi2_seq"] = torch.exp(2 * row_sum).mean() - 1
    return {k: v.float() for k, v in out.items()}


def _importance_weights(log_w_BW: torch.Tensor, cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [B, W], changed [B, W]: where truncation or IcePop altered w) for decoupled mode."""
    if cfg.level == "sequence":
        log_w_BW = log_w_BW.sum(dim=1, keepdim=True).expand_as(log_w_BW)
    w = torch.exp(log_w_BW.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    if cfg.is_kind == "tis":
        return w.clamp(max=cfg.threshold), w > cfg.threshold
    if cfg.is_kind == "icepop":
        outside = (w < cfg.icepop_lo) | (w > cfg.icepop_hi)
        return torch.where(outside, torch.zeros_like(w), w), outside
    return torch.ones_like(w), torch.zeros_like(w, dtype=torch.bool)


def correction_weights(
    logp_old_BW: torch.Tensor, logp_rollout_BW: torch.Tensor, cfg: RolloutCorrectionConfig
) -> CorrectionResult:
    """Weights [B, W] for the per-step losses, and rollout_corr/* metrics.

    logp_old_BW: decoupled mode: the old log-probs recomputed with the current weights before the update;
    bypass mode: the current policy's log-probs (only the rejection statistic reads them).
    logp_rollout_BW: the sampler's log-probs of the same steps.
    """
    if logp_old_BW.ndim != 2 or logp_old_BW.shape != logp_rollout_BW.shape:
        raise ValueError(
            f"logp_old and logp_rollout must both be [B, W]; got {tuple(logp_old_BW.shape)} "
            f"and {tuple(logp_rollout_BW.shape)}"
        )
    with torch.no_grad():
        # fp32: the log-prob differences are small next to the log-probs
        log_w_BW = logp_old_BW.detach().float() - logp_rollout_BW.detach().float()
        if not torch.isfinite(log_w_BW).all():
            raise ValueError("logp_old or logp_rollout holds NaN or inf; rollout correction needs finite log-probs")
        metrics = {}
        if cfg.mode == "decoupled":
            is_BW, changed_BW = _importance_weights(log_w_BW, cfg)
            if cfg.is_batch_normalize:
                mean_w = is_BW.mean()
                factor = mean_w if mean_w > 1e-8 else torch.ones_like(mean_w)
                is_BW = is_BW / factor
                metrics["rollout_corr/is_batch_norm_factor"] = factor
        else:
            is_BW, changed_BW = torch.ones_like(log_w_BW), torch.zeros_like(log_w_BW, dtype=torch.bool)
        keep_BW = torch.ones_like(log_w_BW, dtype=torch.bool)
        chain = rejection_masks(log_w_BW, cfg)
        for name, kept_BW in chain:
            keep_BW = keep_BW & kept_BW
            if len(chain) > 1:
                metrics[f"rollout_corr/rejected_fraction/{name}"] = (~kept_BW).float().mean()
        weights_BW = is_BW * keep_BW.float()
        metrics.update({
            "rollout_corr/abs_dlogp_mean": log_w_BW.abs().mean(),
            "rollout_corr/abs_dlogp_max": log_w_BW.abs().max(),
            "rollout_corr/is_weight_mean": is_BW.mean(),
            "rollout_corr/is_weight_std": is_BW.std(correction=0),
            "rollout_corr/is_changed_fraction": changed_BW.float().mean(),
            "rollout_corr/rejected_fraction": (~keep_BW).float().mean(),
            "rollout_corr/weight_mean": weights_BW.mean(),
        })  # fmt: skip
        metrics.update(offpolicy_metrics(log_w_BW))
    return CorrectionResult(weights_BW=weights_BW.detach(), metrics={k: v.detach() for k, v in metrics.items()})


@dataclass
class Anchor:
    """What the update's ratios are taken against, per trained step: [B, K] log-probs, [B, K, …] step means, and the
    detached [B, K] loss weights of the correction."""

    log_probs: torch.Tensor
    means: torch.Tensor
    weights: torch.Tensor
    metrics: dict[str, float]


class Correction:
    """A rollout correction: the update's anchor (`anchor`, before the update) and its per-step rejection (`reject`,
    inside the loss). This base keeps the rollout's anchor and rejects nothing; each mode overrides one of them."""

    def __init__(self, cfg: RolloutCorrectionConfig):
        self.cfg = cfg

    def anchor(self, rollout: Anchor, old_policy: Callable) -> Anchor:
        """The anchor of the update, given the rollout's (`rollout`: every weight 1) and `old_policy()`, the
        (log-probs, means) [B, K] recomputed with the weights before the update."""
        return rollout

    def reject(
        self, log_prob_B: torch.Tensor, anchor_B1: torch.Tensor, weights_B: torch.Tensor
    ) -> tuple[torch.Tensor, dict]:
        """`weights_B` with 0 for each rejected entry of the trained step, from the current policy's log-probs
        against the anchor's [B, 1]; and the metrics of those entries (declared ROWS above)."""
        return weights_B, {}


class BypassRejection(Correction):
    """Bypass with rejection (rs_level step): the rollout is the anchor; each trained step's entries whose current
    log-prob is too far from the rollout's are left out of the loss."""

    def reject(
        self, log_prob_B: torch.Tensor, anchor_B1: torch.Tensor, weights_B: torch.Tensor
    ) -> tuple[torch.Tensor, dict]:
        corrected = correction_weights(log_prob_B.detach()[:, None], anchor_B1, self.cfg)
        metrics = {k: v for k, v in corrected.metrics.items() if rule_of(k) == ROWS}  # shares of the step's entries
        return weights_B * corrected.weights_BW[:, 0], metrics


class Decoupled(Correction):
    """Decoupled: the old policy, recomputed before the update, is the anchor; π_old / π_rollout weights each entry
    (with its rejection), once for the whole window."""

    def anchor(self, rollout: Anchor, old_policy: Callable) -> Anchor:
        old_log_probs, old_means = old_policy()
        corrected = correction_weights(old_log_probs, rollout.log_probs, self.cfg)
        metrics = {name: float(value) for name, value in corrected.metrics.items()}
        return Anchor(old_log_probs, old_means, corrected.weights_BW, metrics)


def recomputed_forwards(cfg: RolloutCorrectionConfig) -> int:
    """Forwards without gradient per trained step of a sample that the correction runs once per update: 1 where
    the old policy is recomputed (decoupled), 0 where the rollout is the anchor."""
    return int(cfg.mode == "decoupled")


def make_correction(cfg: RolloutCorrectionConfig) -> Correction | None:
    """The collaborator of algorithm.rollout_correction (module docstring); None for bypass without rejection."""
    if cfg.mode == "decoupled":
        return Decoupled(cfg)
    return None if cfg.rs_stat is None else BypassRejection(cfg)
