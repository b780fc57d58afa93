"""Training curves as a PNG, from metrics rows (e.g. `read_metrics(run_dir)`)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to `window` points (fewer at the start), same length as `values`."""
    if window <= 1 or len(values) == 0:
        return values.astype(float)
    sums = np.cumsum(np.concatenate([[0.0], values.astype(float)]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - window)
    return (sums[ends] - sums[starts]) / (ends - starts)


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    points = sorted(
        (row["step"], float(row[key]))
        for row in rows
        if isinstance(row.get(key), int | float) and not isinstance(row.get(key), bool) and math.isfinite(row[key])
    )
    steps = np.array([step for step, _ in points], dtype=float)
    values = np.array([value for _, value in points], dtype=float)
    return steps, values


def plot_metrics(
    rows: Sequence[Mapping[str, Any]],
    out_png: str | os.PathLike[str],
    keys: Sequence[str] = ("reward/mean", "val/reward/mean"),
    smooth: int = 5,
) -> Path | None:
    """One subplot per key found in `rows`: raw points (faint) and a trailing moving average over `smooth` points.

    Keys with no finite value are skipped; when none is left, nothing is written and None is returned.
    """
    # A bare Figure drawn by the Agg canvas: works headless, and unlike pyplot with matplotlib.use("Agg") it
    # neither switches the process-wide backend nor closes a notebook's open figures.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = {key: _series(rows, key) for key in keys}
    series = {key: data for key, data in series.items() if len(data[0])}
    if not series:
        return None

    fig = Figure(figsize=(8, 2.8 * len(series)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)
    for ax, (key, (steps, values)) in zip(axes[:, 0], series.items()):
        ax.plot(steps, values, color="tab:blue", alpha=0.3, linewidth=0.8, marker=".", markersize=3, label="raw")
        if smooth > 1 and len(values) > 1:
            ax.plot(steps, moving_average(values, smooth), color="tab:blue", linewidth=1.8, label=f"mean of {smooth}")
        ax.set_title(key)
        ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    path = Path(out_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
