"""The `guard:` config section (the reward-hacking guard; see diffusion_rl/guard/__init__.py) and the names of the
statistics it may watch (guard/stats.py computes each)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diffusion_rl.config.fields import MAX_COUNT, MAX_PIXELS, Range, opt

IMAGE_STATS = ("brightness", "dark_fraction", "saturated_fraction", "colorfulness", "edge_density", "jpeg_kb")
BATCH_STATS = ("group_diversity",)
ROLLOUT_STATS = IMAGE_STATS + BATCH_STATS
VALIDATION_STATS = ("val_drift",)
ALL_STATS = ROLLOUT_STATS + VALIDATION_STATS

RATIO = Range(0, 1e6, lo_open=True)  # a multiple of a baseline or a std: > 0, far above any useful bound


@dataclass
class GuardConfig:
    enabled: bool = opt(True, "Compute image statistics no reward optimises on every rollout and validation.")
    action: Literal["warn", "stop", "rollback"] = opt(
        "warn",
        "When a statistic leaves its range: warn (log), stop the run, or rollback (load the last checkpoint whose "
        "images were in range, point checkpoints/latest at it, and stop).",
    )
    stats: list[str] = opt(list, f"Statistics to watch (empty = all: {', '.join(ALL_STATS)}).", factory=True)
    baseline_steps: int = opt(
        3,
        "The baseline of a rollout statistic is its mean over the first N training steps (more when they cover fewer "
        "than min_prompts prompts).",
        within=Range(1, MAX_COUNT),
    )
    min_prompts: int = opt(
        16,
        "Rollout statistics are compared as means over spans of steps covering at least this many prompts (the "
        "baseline over the first steps, the current value over the latest): one step of a few prompts swings with "
        "what they ask for.",
        within=Range(1, MAX_COUNT),
    )
    max_relative_change: float | None = opt(
        0.5,
        "Out of range when |value − baseline| > this × |baseline| + the statistic's noise floor (null = off).",
        within=RATIO,
    )
    relative_change: dict[str, float] = opt(
        dict, "Per-statistic max_relative_change, e.g. {brightness: 0.2}.", factory=True, within=RATIO
    )
    max_zscore: float | None = opt(
        None,
        "Also out of range when |value − window mean| > this × window std + the noise floor (null = off).",
        within=RATIO,
    )
    window: int = opt(20, "Previous values the z-score is taken over.", within=Range(3, 100_000))
    max_val_drift: float | None = opt(
        None,
        "Out of range when val_drift (mean |pixel change| / 255 from the reference validation) exceeds this.",
        within=Range(0, 1, lo_open=True),
    )
    patience: int = opt(
        1, "Consecutive out-of-range checks of one statistic before `action` is taken.", within=Range(1, MAX_COUNT)
    )
    remind_every: int = opt(
        25,
        "While a statistic stays out of range, its warning is repeated every N steps (every alert is counted).",
        within=Range(1, MAX_COUNT),
    )
    max_side: int = opt(
        256, "Images are shrunk to this longer side before the statistics (bounded cost).", within=Range(8, MAX_PIXELS)
    )

    def __post_init__(self):
        unknown = sorted(set(self.stats) - set(ALL_STATS)) + sorted(set(self.relative_change) - set(ROLLOUT_STATS))
        if unknown:
            raise ValueError(f"guard: unknown statistics {unknown}; known: {', '.join(ALL_STATS)}")

    @property
    def watched(self) -> tuple[str, ...]:
        return tuple(s for s in ALL_STATS if not self.stats or s in self.stats)
