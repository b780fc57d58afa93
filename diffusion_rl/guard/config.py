"""The `guard:` config section (the reward-hacking guard; see diffusion_rl/guard/__init__.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from diffusion_rl.guard.stats import ALL_STATS, ROLLOUT_STATS
from diffusion_rl.settings import opt


@dataclass
class GuardConfig:
    enabled: bool = opt(True, "Compute image statistics no reward optimises on every rollout and validation.")
    action: Literal["warn", "stop", "rollback"] = opt(
        "warn",
        "When a statistic leaves its range: warn (log), stop the run, or rollback (load the last checkpoint whose "
        "images were in range, point checkpoints/latest at it, and stop).",
    )
    stats: list[str] = opt(list, f"Statistics to watch (empty = all: {', '.join(ALL_STATS)}).", factory=True)
    baseline_steps: int = opt(3, "The baseline of a rollout statistic is its mean over the first N training steps.")
    max_relative_change: float | None = opt(
        0.5, "Out of range when |value − baseline| > this × |baseline| + the statistic's noise floor (null = off)."
    )
    relative_change: dict[str, float] = opt(
        dict, "Per-statistic max_relative_change, e.g. {brightness: 0.2}.", factory=True
    )
    max_zscore: float | None = opt(
        None, "Also out of range when |value − window mean| > this × window std + the noise floor (null = off)."
    )
    window: int = opt(20, "Previous values the z-score is taken over (at least 3 needed).")
    max_val_drift: float | None = opt(
        None, "Out of range when val_drift (mean |pixel change| / 255 from the reference validation) exceeds this."
    )
    patience: int = opt(1, "Consecutive out-of-range checks of one statistic before `action` is taken.")
    remind_every: int = opt(
        25, "While a statistic stays out of range, its warning is repeated every N steps (every alert is counted)."
    )
    max_side: int = opt(256, "Images are shrunk to this longer side before the statistics (bounded cost).")

    def __post_init__(self):
        unknown = sorted(set(self.stats) - set(ALL_STATS)) + sorted(set(self.relative_change) - set(ROLLOUT_STATS))
        if unknown:
            raise ValueError(f"guard: unknown statistics {unknown}; known: {', '.join(ALL_STATS)}")
        for name, value in (("max_relative_change", self.max_relative_change), ("max_zscore", self.max_zscore)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"guard.{name} must be a number > 0 or null, got {value}")
        for stat, value in self.relative_change.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"guard.relative_change.{stat} must be > 0, got {value}")
        if self.max_val_drift is not None and not 0 < self.max_val_drift <= 1:
            raise ValueError(f"guard.max_val_drift is a mean pixel change in (0, 1], got {self.max_val_drift}")
        if self.baseline_steps < 1 or self.window < 3 or self.patience < 1 or self.max_side < 8:
            raise ValueError(
                "guard: need baseline_steps ≥ 1, window ≥ 3, patience ≥ 1 and max_side ≥ 8; got "
                f"{self.baseline_steps}, {self.window}, {self.patience}, {self.max_side}"
            )
        if self.remind_every < 1:
            raise ValueError(f"guard.remind_every must be ≥ 1 step, got {self.remind_every}")

    @property
    def watched(self) -> tuple[str, ...]:
        return tuple(s for s in ALL_STATS if not self.stats or s in self.stats)
