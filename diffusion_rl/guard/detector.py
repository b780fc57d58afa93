"""When a guard statistic is out of range: baseline, relative change, z-score over a window, and a hard cap.

For a rollout statistic s with noise floor f_s (NOISE_FLOOR: changes below it are noise at any baseline):

- a step's value is a mean over that step's prompts, and a step of a few prompts swings with what they ask for (a
  small red triangle or three yellow squares), so the relative rule compares means over spans of steps that cover
  at least `min_prompts` prompts, each step weighted by its prompts;
- baseline b = that mean over the first steps it was measured (at least `baseline_steps` of them, and at least
  `min_prompts` prompts: the policies closest to the base);
- relative rule (after the baseline is known):   |v̄ − b| > r_s · |b| + f_s,   v̄ = the mean over the latest steps
  covering `min_prompts` prompts, r_s = `max_relative_change` or the statistic's own entry in `relative_change`;
- z-score rule (when `max_zscore` z is set, over the previous `window` values, at least 3):
  |v − mean| > z · std + f_s   (population std; v the step's own value: the window's spread already holds the
  prompts' swing);
- `val_drift` is already a change from the reference images: it is out of range when v > `max_val_drift`.

A statistic out of range for `patience` consecutive checks calls for the configured action.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from diffusion_rl.config.guard import GuardConfig

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
    value: float  # the relative rule's: the mean over the latest `span` steps
    baseline: float | None  # the baseline (relative rule), the window mean (z-score), None (cap)
    rule: str  # relative_change | zscore | max
    threshold: float  # the largest allowed |value − baseline| (relative, z-score) or value (max)
    message: str
    act: bool = False  # the streak reached `patience`: the configured action applies
    span: int = 1  # steps the value is a mean over (the relative rule's latest steps); their first one is to blame

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Detector:
    cfg: GuardConfig
    history: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)  # (step, value, prompts)
    streak: dict[str, int] = field(default_factory=dict)

    def baseline_span(self, stat: str) -> int | None:
        """How many first steps the baseline is a mean over: at least baseline_steps, covering at least min_prompts
        prompts (None while there are not enough yet, and for val_drift)."""
        if stat == "val_drift":
            return None
        prompts = 0
        for n, (_, _, p) in enumerate(self.history.get(stat, []), start=1):  # stops at the span: O(span), not O(run)
            prompts += p
            if n >= self.cfg.baseline_steps and prompts >= self.cfg.min_prompts:
                return n
        return None

    def baseline(self, stat: str) -> float | None:
        """The prompt-weighted mean of the baseline's first steps, once there are enough (None before, and for
        val_drift)."""
        n = self.baseline_span(stat)
        return None if n is None else _weighted_mean(self.history[stat][:n])

    def latest(self, stat: str) -> tuple[float, int]:
        """The prompt-weighted mean over the latest steps that cover min_prompts prompts, and how many steps."""
        points, prompts, span = self.history[stat], 0, 0
        while span < len(points) and prompts < self.cfg.min_prompts:
            span += 1
            prompts += points[-span][2]
        return _weighted_mean(points[-span:]), span

    def allowed_change(self, stat: str) -> float | None:
        """The relative rule's largest allowed |value − baseline| (None: no baseline yet, or the rule is off)."""
        b = self.baseline(stat)
        r = self.cfg.relative_change.get(stat, self.cfg.max_relative_change)
        return None if b is None or r is None else r * abs(b) + NOISE_FLOOR[stat]

    def update(self, step: int, values: dict[str, float], prompts: int = 1) -> list[Alert]:
        """Record the step's values (each a mean over `prompts` prompts); the alerts of the statistics out of range
        (each act=True past patience)."""
        alerts = []
        for stat, value in values.items():
            if not math.isfinite(value):
                continue
            earlier = list(self.history.get(stat, []))
            self.history.setdefault(stat, []).append((step, float(value), int(prompts)))
            alert = self._check(step, stat, value, earlier)
            if alert is None:
                self.streak[stat] = 0
                continue
            self.streak[stat] = self.streak.get(stat, 0) + 1
            alert.act = self.streak[stat] >= self.cfg.patience
            alerts.append(alert)
        return alerts

    def _check(self, step: int, stat: str, value: float, earlier: list) -> Alert | None:
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
        if allowed is not None and self.baseline_span(stat) < len(self.history[stat]):  # a baseline step is not checked
            mean, span = self.latest(stat)
            if abs(mean - baseline) > allowed:
                change = f"{(mean - baseline) / abs(baseline):+.0%}" if baseline else f"{mean - baseline:+.4g}"
                message = (
                    f"guard: {stat} at step {step} is {mean:.4g}{_over(span)}, baseline {baseline:.4g} (mean of the "
                    f"first {self.baseline_span(stat)} steps): change {change}, more than the allowed ±{allowed:.4g}"
                )
                return Alert(step, stat, mean, baseline, "relative_change", allowed, message, span=span)
        recent = [v for _, v, _ in earlier[-self.cfg.window :]]
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
        history = {k: [(int(s), float(v), int(p)) for s, v, p in points] for k, points in self.history.items()}
        return {"history": history, "streak": {k: int(n) for k, n in self.streak.items()}}

    def load_state_dict(self, state: dict) -> None:
        # a checkpoint from before prompts were counted holds (step, value): one prompt each
        self.history = {k: [(*p, 1)[:3] for p in v] for k, v in state.get("history", {}).items()}
        self.streak = dict(state.get("streak", {}))


def _weighted_mean(points: list[tuple[int, float, int]]) -> float:
    return float(np.average([v for _, v, _ in points], weights=[p for _, _, p in points]))


def _over(span: int) -> str:
    return "" if span == 1 else f" (mean of the last {span} steps)"
