"""The `algorithm.rollout_correction` section: importance weights and rejection between the rollout's and the trained
policy's log-probs, and its checks. What the settings mean and how the correction runs: algorithms/rollout_correction.py
(the collaborator the policy-gradient algorithm is built with)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diffusion_rl.config.fields import Range, opt

_OPTIONS = {
    "mode": ("bypass", "decoupled"),
    "level": ("step", "sequence"),
    "is_kind": ("tis", "icepop", "none"),
    "rs_stat": (None, "k1", "k2", "k3"),
    "rs_level": ("step", "sum", "mean", "max"),
}
# a bound of w or of a rejection statistic: finite and > 0 (exp(20) ≈ 4.9e8 is as far as log w reaches:
# rollout_correction.SAFETY_BOUND)
BOUND = Range(0, 1e8, lo_open=True)


def _check_criterion(stat, bound, level, where: str):
    """The checked bound of one rejection criterion: (lo, hi) for k1, one float otherwise."""
    if stat not in _OPTIONS["rs_stat"][1:]:
        raise ValueError(f"{where}: rs_stat must be one of {list(_OPTIONS['rs_stat'])}, got {stat!r}")
    if level not in _OPTIONS["rs_level"]:
        raise ValueError(f"{where}: rs_level must be one of {list(_OPTIONS['rs_level'])}, got {level!r}")
    if bound is None:
        raise ValueError(f"{where}: rs_stat={stat} needs rs_bound (k1: [lo, hi] or h; k2/k3: an upper bound)")
    if stat == "k1":
        if isinstance(bound, (list, tuple)):
            if len(bound) != 2:
                raise ValueError(f"{where}: k1 rs_bound must be [lo, hi] or one number h; got {bound}")
            lo, hi = (float(b) for b in bound)
        else:
            lo, hi = 1.0 / float(bound), float(bound)
        if not 0 < lo <= 1 <= hi:
            raise ValueError(f"{where}: k1 rs_bound needs 0 < lo ≤ 1 ≤ hi (h ≥ 1 for one number); got lo={lo}, hi={hi}")
        if level == "max":
            raise ValueError(f"{where}: rs_level max is not defined for k1 (signed, its max bounds one side); use step")
        return (lo, hi)
    if isinstance(bound, (list, tuple)) or float(bound) <= 0:
        raise ValueError(f"{where}: {stat} rs_bound must be one number > 0, got {bound}")
    return float(bound)


@dataclass
class RejectionCriterion:
    """One more rejection criterion of the chain (rs_chain): the same meaning as rs_stat / rs_bound / rs_level."""

    stat: Literal["k1", "k2", "k3"] = opt("k3", "Rejection statistic k1, k2 or k3.")
    bound: float | tuple[float, float] | None = opt(
        None, "k2/k3: upper bound; k1: [lo, hi] or h = [1/h, h].", within=BOUND
    )
    level: Literal["step", "sum", "mean", "max"] = opt("step", "Reject single steps, or samples by the window.")

    def __post_init__(self):
        self.bound = _check_criterion(self.stat, self.bound, self.level, "rollout correction rs_chain entry")

    @property
    def name(self) -> str:
        return f"{self.stat}_{self.level}"


@dataclass
class RolloutCorrectionConfig:
    mode: Literal["bypass", "decoupled"] = opt("bypass", "bypass: old = rollout log-probs; decoupled: recomputed.")
    level: Literal["step", "sequence"] = opt("step", "IS weight per step, or one per sample (window sum).")
    is_kind: Literal["tis", "icepop", "none"] = opt("tis", "Decoupled only: truncate w, zero it outside, or w=1.")
    # the bounds keep w = 1 (on-policy) as it is: a cap below 1 or an IcePop window without 1 would shrink it
    threshold: float = opt(2.0, "tis: w is capped at this.", within=Range(1, 1e8))
    icepop_lo: float = opt(0.5, "icepop: w below this becomes 0.", within=Range(0, 1, lo_open=True))
    icepop_hi: float = opt(2.0, "icepop: w above this becomes 0.", within=Range(1, 1e8))
    rs_stat: Literal["k1", "k2", "k3"] | None = opt(None, "Rejection statistic; null = no rejection.")
    rs_bound: float | tuple[float, float] | None = opt(
        None, "k2/k3: upper bound; k1: [lo, hi] or h = [1/h, h].", within=BOUND
    )
    rs_level: Literal["step", "sum", "mean", "max"] = opt("step", "Reject single steps, or samples by the window.")
    rs_chain: list[RejectionCriterion] = opt(
        list, "More rejection criteria [{stat, bound, level}]; an entry must pass all (rs_stat's too).", factory=True
    )
    is_batch_normalize: bool = opt(False, "Decoupled: divide the IS weights by their mean (over a worker's rows).")

    def __post_init__(self):
        for name, valid in _OPTIONS.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"rollout correction {name} must be one of {list(valid)}, got {getattr(self, name)!r}")
        self.rs_chain = [c if isinstance(c, RejectionCriterion) else RejectionCriterion(**c) for c in self.rs_chain]
        if self.rs_stat is None:
            if self.rs_bound is not None:
                raise ValueError(f"rs_bound={self.rs_bound} is set but rs_stat is null; set rs_stat to k1, k2 or k3")
            if self.rs_chain:
                raise ValueError("rs_chain adds criteria to rs_stat's; set rs_stat (the first criterion) as well")
            return
        self.rs_bound = _check_criterion(self.rs_stat, self.rs_bound, self.rs_level, "rollout correction")

    @property
    def criteria(self) -> list[RejectionCriterion]:
        """Every rejection criterion, rs_stat's first; empty without rejection."""
        if self.rs_stat is None:
            return []
        return [RejectionCriterion(self.rs_stat, self.rs_bound, self.rs_level), *self.rs_chain]

    @property
    def active(self) -> bool:
        """False when the weights are all ones (bypass without rejection): the caller may skip them."""
        return self.mode == "decoupled" or self.rs_stat is not None
