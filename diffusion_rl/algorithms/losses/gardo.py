"""GARDO (He et al., "GARDO: Reinforcing Diffusion Models without Reward Hacking", arXiv 2512.24138): Flow-GRPO with
a KL penalty only on the samples where the reward is least trusted, to a reference that is reset to the policy from
time to time, and with the advantage of a good sample scaled by how far it is from its group's other samples.

On the driver (`Gardo.prepare`), from the step's scores and the guard's image statistics of the same rows (computed
once, by the guard: `RewardResult.image_stats`, guard/stats.py):

    A_i      = the group-relative advantage of `algorithm.advantage` (Flow-GRPO's)
    d_i      = min over j ≠ i in i's group of mean|x_i − x_j| / 255      (the guard's pairwise differences)
    A'_i     = A_i · d_i / mean_group(d)    where A_i > 0;    A_i elsewhere            (`diversity`)
    u_i      = mean over the judges J of rank_J(i) − rank_R(i)     ranks over the batch's scored rows, 1 = best:
               R the total reward; a judge is a reward by name (higher is better) or `guard` (the row's `drift`
               from the guard's baselines: lower is better). u_i > 0: the reward ranks i above its judges
               (the paper's sign; the authors' released scripts gate −u_i, `gate_rows: reward_below_judges`:
               docs/gardo.md)
    β_t      = the gated share, kept in [gate_min, gate_max]: × (1 + gate_rate) when the mean of this step's
               u ≥ 0 exceeds every one of the last `gate_window` steps', × (1 − gate_rate) when it is below all
    g_i      = 1 if u_i > the (1 − β_t) quantile of the step's u ≥ 0 (linear), else 0
    kl_w_i   = g_i / mean(g)    (0 when no row is gated): `Targets.kl_weights`

On the worker (`gardo_loss`, per trained step; the reference is the named policy `gardo_reference`):

    policy_i = max(−A'_i·ratio_i, −A'_i·clamp(ratio_i, 1 ± clip_range)),   A' clamped to ±adv_clip_max
    kl_i     = mean over the non-batch dims of (mean_i − ref_mean_i)² / (2·std_i²)     (policy_gradient.py)
    loss     = mean_i of weight_i · (policy_i + kl_beta · kl_w_i · kl_i)

so the KL term is kl_beta times the mean of kl_i over the step's gated rows. After each update (`Gardo.end`) the
reference is reset to the trained policy when the mean kl_i over the update's gated rows (all workers) exceeded
`kl_threshold`, or when more than `reset_every` steps passed since the last reset; it starts as the initial
policy. The reference, the last reset's step and the gate's history are in every checkpoint, so a resumed run
resets at the same steps to the same reference. docs/gardo.md lists each convention with its
place in the authors' code and our deviations. Metrics: flow_grpo's, gardo/kl_gated (per pass: the mean kl_i over
its gated rows), gardo/kl_measured and gardo/reset (per update), gardo/diversity_weight, gardo/gate_share (β_t),
gardo/gated_fraction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch

from diffusion_rl.algorithms.base import LossOutput, register_loss
from diffusion_rl.algorithms.losses.flow_grpo import flow_grpo_loss
from diffusion_rl.algorithms.policy_gradient import ClippedLossSettings, PolicyGradient, PolicyLossInput
from diffusion_rl.config.fields import MAX_COUNT, Range, check, opt
from diffusion_rl.errors import UserError

REFERENCE = "gardo_reference"  # the named policy the KL is taken to, reset to the trained one (kept in checkpoints)
GUARD_JUDGE = "guard"
SHARE = Range(0, 1, lo_open=True)


@dataclass
class GardoSettings(ClippedLossSettings):
    kl_beta: float = opt(
        0.04, "Weight of the gated KL to the reset reference (the authors' OCR config: 0.04).", within=Range(0, 1e4)
    )
    kl_threshold: float = opt(
        3e-4, "Reset the reference after an update whose mean gated KL exceeds this.", within=Range(0, 1e6)
    )
    reset_every: int = opt(15, "Also reset when more than this many steps passed since the last reset.",
                           within=Range(1, MAX_COUNT))  # fmt: skip
    diversity: bool = opt(True, "Scale positive advantages by the sample's distance to its group (d_i / mean d).")
    gate_judges: list[str] = opt(
        lambda: [GUARD_JUDGE],
        "What the reward's ranking is compared with: reward names (their scores, higher is better) and/or "
        "'guard' (each image's drift from the guard's baselines, lower is better).",
        factory=True,
    )
    gate_rows: Literal["reward_above_judges", "reward_below_judges"] = opt(
        "reward_above_judges",
        "Which disagreement is gated: rows the reward ranks above its judges (the paper's aim: the reward's least "
        "trusted wins), or below them (the sign of the authors' released scripts; docs/gardo.md).",
    )
    gate_share: float = opt(0.1, "Starting share of the rows with u ≥ 0 that are gated (β).", within=SHARE)
    gate_min: float = opt(0.02, "Smallest gated share.", within=SHARE)
    gate_max: float = opt(0.2, "Largest gated share.", within=SHARE)
    gate_rate: float = opt(0.1, "Relative change of the share when u's mean leaves its recent range.", within=SHARE)
    gate_window: int = opt(20, "Steps of u's mean the share's change is judged against.", within=Range(1, MAX_COUNT))

    def __post_init__(self):
        check(self.gate_min <= self.gate_share <= self.gate_max,
              f"algorithm.gardo: gate_min ≤ gate_share ≤ gate_max, got {self.gate_min}, {self.gate_share}, "
              f"{self.gate_max}")  # fmt: skip
        check(bool(self.gate_judges), "algorithm.gardo.gate_judges: name at least one judge ('guard' or a reward)")

    def check_config(self, algorithm, sampling) -> None:
        check(sampling.tree is None, "algorithm.loss=gardo trains flat groups: remove sampling.tree")

    def check_run(self, cfg) -> None:
        """What GARDO reads from the guard and the rewards: the guard on, watching what it needs, the judges named."""
        needs = {"group_diversity"} if self.diversity else set()
        guard_judge = GUARD_JUDGE in self.gate_judges and self.kl_beta > 0
        if self.diversity or guard_judge:
            check(cfg.guard.enabled, "algorithm.loss=gardo reads the guard's image statistics: set guard.enabled=true")
        watched = set(cfg.guard.watched)
        check(needs <= watched, "algorithm.gardo.diversity reads the guard's group_diversity: add it to guard.stats")
        check(not guard_judge or len(watched - {"group_diversity", "val_drift"}) > 0,
              "algorithm.gardo.gate_judges 'guard' ranks by the guard's per-image statistics: guard.stats watches "
              "none")  # fmt: skip
        rewards = [r.metric_name for r in cfg.rewards]
        unknown = [j for j in self.gate_judges if j != GUARD_JUDGE and j not in rewards]
        check(not unknown, f"algorithm.gardo.gate_judges: {unknown} name no reward; rewards: {', '.join(rewards)}")


def diversity_weights(nearest_B: np.ndarray, groups_B: np.ndarray, adv_B: np.ndarray) -> np.ndarray:
    """float64 [B]: d_i / mean of d over i's group where A_i > 0, else 1 (also 1 where the group's mean is 0 or
    not finite: a group of identical images, or a row alone)."""
    weights = np.ones(len(adv_B))
    for g in np.unique(groups_B):
        rows = np.flatnonzero(groups_B == g)
        mean = float(np.mean(nearest_B[rows]))
        if np.isfinite(mean) and mean > 0:
            up = rows[adv_B[rows] > 0]
            weights[up] = nearest_B[up] / mean
    return weights


def descending_ranks(values_B: np.ndarray) -> np.ndarray:
    """float64 [B]: 1 for the largest value, 2 for the next, … (ties: the earlier row ranks first)."""
    ranks = np.empty(len(values_B))
    ranks[np.argsort(-values_B, kind="stable")] = np.arange(1, len(values_B) + 1)
    return ranks


def disagreement(total_B: np.ndarray, judges: list[np.ndarray]) -> np.ndarray:
    """float64 [B]: u_i = mean over the judges of their rank of i − the reward's rank of i, over the rows every score
    holds (NaN elsewhere). Each judge's scores are higher-is-better."""
    valid = np.isfinite(total_B) & np.all([np.isfinite(j) for j in judges], axis=0)
    u = np.full(len(total_B), np.nan)
    if valid.any():
        judged = np.mean([descending_ranks(j[valid]) for j in judges], axis=0)
        u[valid] = judged - descending_ranks(total_B[valid])
    return u


@dataclass
class GateShare:
    """β_t, the gated share, moved by u's mean against its recent history (the module docstring)."""

    share: float
    history: list[float]

    def update(self, u_B: np.ndarray, s: GardoSettings) -> float:
        """β_t after this step's u (its rows with u ≥ 0); unchanged, history too, when no row has u ≥ 0."""
        scores = u_B[np.isfinite(u_B) & (u_B >= 0)]
        if len(scores) == 0:
            return self.share
        mean = float(scores.mean())
        if not self.history:
            self.share = s.gate_share
        elif mean > max(self.history):
            self.share *= 1 + s.gate_rate
        elif mean < min(self.history):
            self.share *= 1 - s.gate_rate
        self.share = float(np.clip(self.share, s.gate_min, s.gate_max))
        self.history = (self.history + [mean])[-s.gate_window :]
        return self.share


def gate(u_B: np.ndarray, share: float) -> np.ndarray:
    """bool [B]: u_i above the (1 − share) quantile of the rows' u ≥ 0 (numpy's linear percentile)."""
    scores = u_B[np.isfinite(u_B) & (u_B >= 0)]
    if len(scores) == 0:
        return np.zeros(len(u_B), dtype=bool)
    threshold = np.percentile(scores, 100 - share * 100)
    return np.nan_to_num(u_B, nan=-np.inf) > threshold


def gate_weights(gated_B: np.ndarray, kept_B: np.ndarray) -> tuple[np.ndarray, float]:
    """(float [B] g_i / mean of g over the rows the loss keeps, 0 everywhere when none of them is gated; that mean):
    the loss's mean over its kept rows of g_i/mean(g)·kl_i is then the mean of kl_i over the kept gated rows, as
    the authors' mean over the gated rows that survive their drop of zero-advantage rows."""
    kept = kept_B.astype(bool)
    share = float(gated_B[kept].mean()) if kept.any() else 0.0
    return (gated_B / share if share > 0 else np.zeros(len(gated_B))), share


def gardo_loss(inp: PolicyLossInput, cfg) -> LossOutput:
    """flow_grpo's loss, its KL term weighted per row by inp.kl_weights (policy_gradient.py `kl_to_reference`), and
    gardo/kl_gated: the kl_weights-weighted mean of kl_i (the mean over the gated rows; 0 when none is)."""
    out = flow_grpo_loss(inp, cfg)
    rows, kl_ref = float(inp.log_prob.shape[0]), out.metrics["kl_ref"]
    if inp.kl_weights is None:
        out.metrics["gardo/kl_gated"] = kl_ref * rows / rows  # the weighted case's arithmetic, its rounding too
        return out
    total = inp.kl_weights.sum()  # stays on the device: the loss path reads nothing back (algorithms/hot_path.py)
    out.metrics["gardo/kl_gated"] = torch.where(total > 0, kl_ref * rows / total, torch.zeros_like(kl_ref))
    return out


class Gardo(PolicyGradient):
    """The policy-gradient update with GARDO's targets (driver) and its gated KL to a reset reference (worker)."""

    @classmethod
    def needs_reference(cls, settings) -> bool:
        return False  # its reference is its own named policy, not the frozen start

    @classmethod
    def frozen_calls(cls, algorithm, sampling, guidance_cost) -> int:
        return int(algorithm.settings.kl_beta > 0)  # the reference's forward per trained call

    def __init__(self, section, spec, **context):
        super().__init__(section, spec, **context)
        self.gate_share = GateShare(self.settings.gate_share, [])  # the driver's
        self.last_reset = 0  # the worker's: the step (updates done) the reference was last set to the policy
        self.loss_fn = self._gated_loss
        self._kl_of_sample: torch.Tensor | None = None
        self._chunk_kl: torch.Tensor | None = None
        self._kl_sum, self._gated = 0.0, 0.0

    # -- driver --------------------------------------------------------------------------------------------------
    def prepare(self, scored, group_index: torch.Tensor):
        targets, metrics = super().prepare(scored, group_index)
        s, stats = self.settings, scored.image_stats
        reads_stats = s.diversity or (s.kl_beta > 0 and GUARD_JUDGE in s.gate_judges)
        if reads_stats and stats is None:
            raise UserError("algorithm.loss=gardo found no image statistics from the guard (guard.enabled=true)")
        if s.diversity:
            weights = diversity_weights(stats.nearest(), group_index.numpy(), targets.advantages.numpy())
            targets.advantages = targets.advantages * torch.from_numpy(weights).float()
            up = targets.advantages > 0
            metrics["gardo/diversity_weight"] = float(weights[up.numpy()].mean()) if bool(up.any()) else 1.0
        if s.kl_beta > 0:
            judges = [-stats.drift if j == GUARD_JUDGE else scored.per_reward[j] for j in s.gate_judges]
            u = disagreement(np.asarray(scored.total, dtype=np.float64), [np.asarray(j, np.float64) for j in judges])
            u = u if s.gate_rows == "reward_above_judges" else -u
            gated = gate(u, self.gate_share.update(u, s))
            kept = (targets.advantages != 0).numpy() if self.section.drop_zero_advantage else np.ones_like(gated)
            weights, share = gate_weights(gated, kept)
            targets.kl_weights = torch.from_numpy(weights).float()
            metrics.update({"gardo/gate_share": self.gate_share.share, "gardo/gated_fraction": share})
        return targets, metrics

    # -- worker --------------------------------------------------------------------------------------------------
    def attach(self, model) -> None:
        super().attach(model)
        if self.kl_beta > 0:
            model.policies.add(REFERENCE)  # starts as the initial policy

    def begin(self, batch, step):
        units, metrics = super().begin(batch, step)
        if self.kl_beta > 0:  # each row's KL weight, found again by sample index in every chunk
            ids = batch.traj.ids.sample_index.to(torch.long)
            self._kl_of_sample = torch.zeros(int(ids.max()) + 1, device=units.weight.device)
            self._kl_of_sample[ids.to(units.weight.device)] = batch.targets.kl_weights.to(units.weight.device)
            self._kl_sum, self._gated = 0.0, 0.0
        return units, metrics

    def _reference_mean(self, units, k: int) -> torch.Tensor:
        with torch.no_grad(), self.model.policies.using(REFERENCE):
            mean = self._recompute(units.traj, units.columns[:, k]).mean
        ids = units.traj.ids.sample_index.to(device=units.weight.device, dtype=torch.long)
        self._chunk_kl = self._kl_of_sample[ids] * (units.weight > 0)  # padding rows are never gated
        return mean

    def _gated_loss(self, inp: PolicyLossInput, cfg) -> LossOutput:
        out = gardo_loss(replace(inp, kl_weights=self._chunk_kl), cfg)
        if self._chunk_kl is not None:  # summed in fp64 on the device, read once in `end`
            gated = (self._chunk_kl > 0).sum().double()
            self._kl_sum = self._kl_sum + out.metrics["gardo/kl_gated"].double() * gated
            self._gated = self._gated + gated
        return out

    def end(self, step: int) -> dict[str, float]:
        """After the update of step `step`: reset the reference when its gated KL passed the threshold (the mean
        over every worker's gated rows) or `reset_every` steps have passed since the last reset."""
        if self.kl_beta <= 0:
            return {}
        total, count = self.sum_over_workers(float(self._kl_sum)), self.sum_over_workers(float(self._gated))
        kl = total / count if count > 0 else 0.0
        reset = kl > self.settings.kl_threshold or step + 1 - self.last_reset > self.settings.reset_every
        if reset:
            self.model.policies.copy(REFERENCE)
            self.last_reset = step + 1
        return {"gardo/kl_measured": kl, "gardo/reset": float(reset)}

    # -- checkpoint ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"gate_share": self.gate_share.share, "gate_history": list(self.gate_share.history),
                "last_reset": self.last_reset}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.gate_share = GateShare(float(state["gate_share"]), [float(x) for x in state["gate_history"]])
            self.last_reset = int(state["last_reset"])


register_loss("gardo", settings=GardoSettings, algorithm=Gardo)(gardo_loss)
