"""A one-line progress summary through the `logging` module, every N steps."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np

from diffusion_rl.tracking.base import to_scalar

logger = logging.getLogger(__name__)

# (metric key, label in the line, format). Keys absent from a call are left out of its line.
DEFAULT_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward/mean", "reward", "{:.4f}"),
    ("val/reward/mean", "val_reward", "{:.4f}"),
    ("loss", "loss", "{:.4g}"),
    ("kl", "kl", "{:.3g}"),
    ("timing/step", "s/step", "{:.2f}"),
    ("images/s", "img/s", "{:.1f}"),
)


class ConsoleTracker:
    """Logs e.g. `step 120 | reward 0.6123 | loss 0.0123 | kl 0.0004 | s/step 3.21 | img/s 9.9` at INFO.

    Only calls whose step is a multiple of `every` and that carry at least one of `fields` produce a line.
    """

    def __init__(self, every: int = 1, fields: Sequence[tuple[str, str, str]] = DEFAULT_FIELDS) -> None:
        if every < 1:
            raise ValueError(f"ConsoleTracker(every={every}): log every N >= 1 steps (leave it out to disable)")
        self.every = every
        self.fields = tuple(fields)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if step % self.every != 0:
            return
        parts = []
        for key, label, fmt in self.fields:
            if key in metrics:
                value = to_scalar(key, metrics[key])
                text = fmt.format(value) if math.isfinite(value) else str(value)
                parts.append(f"{label} {text}")
        if parts:
            logger.info("step %d | %s", step, " | ".join(parts))

    def log_images(self, tag: str, image: np.ndarray, step: int, caption: str = "") -> None:
        pass

    def close(self) -> None:
        pass
