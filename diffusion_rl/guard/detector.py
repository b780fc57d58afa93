"""When a guard statistic is out of range: baseline, relative change, z-score over a window, and a hard cap.

For a rollout statistic s with noise floor f_s (NOISE_FLOOR: changes below it are noise at any baseline):

- baseline b = mean of s over the first `baseline_steps` steps it was measured (the policy closest to the base);
- relative rule (after the baseline is known):   |v − b| > r_s · |b| + f_s,   r_s = `max_relative_change` or the
  statistic's own entry in `relative_change`;
- z-score rule (when `max_zscore` z is set, over the previous `window` values, at least 3):
  |v − mean| > z · std + f_s   (population std);
- `val_drift` is already a change from the reference images: it is out of range when v > `max_val_drift`.

A statistic out of range for `patience` consecutive checks calls for the configured action.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from diffusion_rl.guard.config import GuardConfig

# changes smaller than these are noise whatever the baseline (a fraction near 0 would make any change "relative")
NOISE_FLOOR = {
    "brightness": 0.02,
    "dark_fraction": 0.02,
    "saturated_fraction": 0.02,
    "colorfulness": 2.0,
    "edge_density": 0.02,
    "jpeg_kb": 0.05,
    "group_diversity": 0.01,
    "val_drift": 0.0,
}
MIN_ZSCORE_POINTS = 3


@dataclass
class Alert:
    """One statistic out of range at one step."""

    step: int
    stat: str
    value: float
    baseline: float | None  # the baseline (relative rule), the window mean (z-score), None (cap)
    rule: str  # relative_change | zscore | max
    threshold: float  # the largest allowed |value − baseline| (relative, z-score) or value (max)
    message: str
    act: bool = False  # the streak reached `patience`: the configured action applies

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Detector:
    cfg: GuardConfig
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    streak: dict[str, int] = field(default_factory=dict)

    def baseline(self, stat: str) -> float | None:
        """The mean of the first baseline_steps values, once there are that many (None before, and for val_drift)."""
        points = self.history.get(stat, [])
        if stat == "val_drift" or len(points) < self.cfg.baseline_steps:
            return None
        return float(np.mean([v for _, v in points[: self.cfg.baseline_steps]]))

    def allowed_change(self, stat: str) -> float | None:
        """The relative rule's largest allowed |value − baseline| (None: no baseline yet, or the rule is off)."""
        b = self.baseline(stat)
        r = self.cfg.relative_change.get(stat, self.cfg.max_relative_change)
        return None if b is None or r is None else r * abs(b) + NOISE_FLOOR[stat]

    def update(self, step: int, values: dict[str, float]) -> list[Alert]:
        """Record the step's values; the alerts of the statistics out of range (each act=True past patience)."""
        alerts = []
        for stat, value in values.items():
            if not math.isfinite(value):
                continue
            alert = self._check(step, stat, value)
            self.history.setdefault(stat, []).append((step, float(value)))
            if alert is None:
                self.streak[stat] = 0
                continue
            self.streak[stat] = self.streak.get(stat, 0) + 1
            alert.act = self.streak[stat] >= self.cfg.patience
            alerts.append(alert)
        return alerts

    def _check(self, step: int, stat: str, value: float) -> Alert | None:
        if stat == "val_drift":
            cap = self.cfg.max_val_drift
            if cap is not None and value > cap:
                message = (
                    f"guard: val_drift at step {step} is {value:.4g} (mean |pixel change| / 255 from the reference "
                    f"validation images), above max_val_drift={cap:g}"
                )
                return Alert(step, stat, value, None, "max", cap, message)
            return None
        baseline, allowed = self.baseline(stat), self.allowed_change(stat)
        if allowed is not None and abs(value - baseline) > allowed:
            change = f"{(value - baseline) / abs(baseline):+.0%}" if baseline else f"{value - baseline:+.4g}"
            message = (
                f"guard: {stat} at step {step} is {value:.4g}, baseline {baseline:.4g} (mean of the first "
                f"{self.cfg.baseline_steps} steps): change {change}, more than the allowed ±{allowed:.4g}"
            )
            return Alert(step, stat, value, baseline, "relative_change", allowed, message)
        recent = [v for _, v in self.history.get(stat, [])[-self.cfg.window :]]
        if self.cfg.max_zscore is not None and len(recent) >= MIN_ZSCORE_POINTS:
            mean, std = float(np.mean(recent)), float(np.std(recent))
            allowed = self.cfg.max_zscore * std + NOISE_FLOOR[stat]
            if abs(value - mean) > allowed:
                z = (value - mean) / std if std > 0 else math.inf
                message = (
                    f"guard: {stat} at step {step} is {value:.4g}, {z:+.1f} standard deviations from the mean "
                    f"{mean:.4g} of the previous {len(recent)} steps (allowed ±{allowed:.4g})"
                )
                return Alert(step, stat, value, mean, "zscore", allowed, message)
        return None

    def state_dict(self) -> dict:
        # plain numbers only: a checkpoint's state.pt is read with torch's weights_only loader
        history = {k: [(int(step), float(value)) for step, value in v] for k, v in self.history.items()}
        return {"history": history, "streak": {k: int(n) for k, n in self.streak.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: [tuple(p) for p in v] for k, v in state.get("history", {}).items()}
        self.streak = dict(state.get("streak", {}))
