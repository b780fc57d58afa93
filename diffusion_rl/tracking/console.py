"""A one-line progress summary through the `logging` module: at the first step, every N steps, and at the last; in a
log without a progress bar (not a terminal) also at the 2nd, 4th, 8th, … step of the run before the first periodic
line, so a run says how it goes (and when it ends) long before step N.

Each line shows what a person can read off a run: the reward, the validation reward when there is one, the clip
fraction and KL to the reference only when they are not zero (on-policy Flow-GRPO clips nothing, and the policy
loss itself is ~0 by construction: ratio 1 times zero-mean advantages), the guard's alerts so far when there are
any, seconds per step and the time left.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence

import numpy as np

from diffusion_rl.tracking.base import to_scalar

logger = logging.getLogger(__name__)

# (metric key, label in the line, format, shown when zero). Keys absent from a call are left out of its line.
REWARD_FIELD = ("reward/mean", "reward", "{:.5g}", True)  # replaced by `rewards` (ConsoleTracker)
DEFAULT_FIELDS: tuple[tuple[str, str, str, bool], ...] = (
    REWARD_FIELD,
    ("val/reward/mean", "val_reward", "{:.5g}", True),
    ("reward/failed_fraction", "failed", "{:.2%}", False),
    ("clip_fraction", "clipped", "{:.2%}", False),
    ("kl_ref", "kl_ref", "{:.3g}", False),
    ("guard/alerts_total", "guard_alerts", "{:.0f}", False),  # the guard warns once per excursion: the count goes on
    ("timing/step", "s/step", "{:.2f}", True),
)


def bar_shown(enabled: bool) -> bool:
    """Whether the trainer's progress bar is drawn (log.progress_bar, on a terminal); else the console's early lines
    take its place."""
    return enabled and sys.stderr.isatty()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class ConsoleTracker:
    """Logs e.g. `step 20/100 | reward -0.0123 | val_reward -0.0119 | s/step 3.21 | eta 4m17s` at INFO.

    A line at the first step a run logs, at every multiple of `every`, and at `total_steps`; with `early` (no progress
    bar) also at the 2nd, 4th, 8th, … step since the first before `every`. The ETA is the mean time per step so far
    (of this process) times the steps left.
    """

    def __init__(
        self,
        every: int = 1,
        total_steps: int | None = None,
        fields: Sequence[tuple[str, str, str, bool]] = DEFAULT_FIELDS,
        rewards: Sequence[tuple[str, str]] | None = None,
        early: bool = False,
    ) -> None:
        """rewards: (metric key, label) to show in place of the reward total (rewards/build.py console_rewards)."""
        if every < 1:
            raise ValueError(f"ConsoleTracker(every={every}): log every N >= 1 steps (leave it out to disable)")
        self.every, self.total_steps, self.early = every, total_steps, early
        if rewards is not None:
            shown = [(key, label, "{:.5g}", True) for key, label in rewards]
            fields = [f for field in fields for f in (shown if field == REWARD_FIELD else [field])]
        self.fields = tuple(fields)
        self.first_step: int | None = None
        self.start = time.perf_counter()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if step == 0:  # validation before training: no step yet
            return
        first = self.first_step is None
        if first:
            self.first_step, self.start = step - 1, time.perf_counter() - float(metrics.get("timing/step", 0.0))
        done = step - self.first_step  # steps of this process: 1, 2, …
        early = self.early and step < self.every and done & (done - 1) == 0  # a power of two
        if not (first or early or step % self.every == 0 or step == self.total_steps):
            return
        parts = []
        for key, label, fmt, show_zero in self.fields:
            if key in metrics:
                value = to_scalar(key, metrics[key])
                if value == 0 and not show_zero:
                    continue
                parts.append(f"{label} {fmt.format(value) if math.isfinite(value) else value}")
        where = f"{step}/{self.total_steps}" if self.total_steps else f"{step}"
        if self.total_steps and step < self.total_steps:
            per_step = (time.perf_counter() - self.start) / done
            parts.append(f"eta {_duration(per_step * (self.total_steps - step))}")
        logger.info("step %s | %s", where, " | ".join(parts))

    def log_images(self, tag: str, image: np.ndarray, step: int, caption: str = "") -> None:
        pass

    def log_video(self, tag: str, video: np.ndarray, step: int, caption: str = "", fps: float = 8) -> None:
        pass

    def close(self) -> None:
        pass


def run_summary(rows: Sequence[Mapping[str, float]]) -> list[str]:
    """The lines a finished run closes with: the training reward over its first and last tenth of steps, each as a
    mean ± its standard error over those steps (a step's batch is a few prompts and its mean swings with them: a
    change within the errors is noise), then the validation reward before and after (fixed prompts and seeds)."""
    rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    vals = [r["val/reward/mean"] for r in rows if r.get("val/reward/mean") is not None]
    lines = []
    if rewards:
        k = max(1, len(rewards) // 10)
        ends = [_mean_and_error(rewards[:k]), _mean_and_error(rewards[-k:])]
        first, last = (f"{mean:.5g}" + (f" ± {error:.2g}" if k > 1 else "") for mean, error in ends)
        lines.append(f"reward/mean: first {k} step(s) {first}, last {k} {last}")
    if len(vals) >= 2:
        lines.append(f"val/reward/mean: before {vals[0]:.5g}, after {vals[-1]:.5g}")
    return lines


def _mean_and_error(values: Sequence[float]) -> tuple[float, float]:
    """The mean of `values` and its standard error (sample standard deviation / √n; 0 for one value)."""
    error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.fmean(values), error
