"""Training curves as a PNG, from metrics rows (e.g. `read_metrics(run_dir)`).

What is drawn (see `plan_panels`): one panel per key with a finite value; every logged point, raw; and a trailing
mean only over a dense training series (not `val/...`, which is logged every few steps: averaging 5 validations
would blend the start of a run into its end) and only when it has more than twice the window of points. The
smoothed line's legend says what it is ("trailing mean of 5 steps"). With `skip_constant`, a key whose values are
all exactly 0, or one value at every one of several steps (the clip fraction and KLs of an on-policy run, its ratio
of 1), gets no panel: it carries no information (`constant_value` says which value, for a note).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diffusion_rl.utils.files import naming


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to `window` points (fewer at the start), same length as `values`."""
    if window <= 1 or len(values) == 0:
        return values.astype(float)
    sums = np.cumsum(np.concatenate([[0.0], values.astype(float)]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - window)
    return (sums[ends] - sums[starts]) / (ends - starts)


def metric_series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of every row with a finite number under `key`, in step order."""
    points = sorted(
        (row["step"], float(row[key]))
        for row in rows
        if isinstance(row.get(key), int | float) and not isinstance(row.get(key), bool) and math.isfinite(row[key])
    )
    steps = np.array([step for step, _ in points], dtype=float)
    values = np.array([value for _, value in points], dtype=float)
    return steps, values


def constant_value(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The value `key` has at every step it is logged, when that is 0, or one value over several steps; else None."""
    return _constant(metric_series(rows, key)[1])


def _constant(values: np.ndarray) -> float | None:
    if len(values) and not np.any(values):
        return 0.0
    if len(values) > 1 and np.all(values == values[0]):
        return float(values[0])
    return None


@dataclass
class Panel:
    key: str
    steps: np.ndarray
    values: np.ndarray
    smooth: int  # window of the trailing mean drawn over the raw points; 0 = none


def plan_panels(
    rows: Sequence[Mapping[str, Any]], keys: Sequence[str], smooth: int = 5, skip_constant: bool = False
) -> list[Panel]:
    """The panels `plot_metrics` draws, in order (module docstring): keys without data, and with `skip_constant`
    keys with one value throughout (`constant_value`), are left out."""
    panels = []
    for key in keys:
        steps, values = metric_series(rows, key)
        if not len(values) or (skip_constant and _constant(values) is not None):
            continue
        dense = not key.startswith("val/") and smooth > 1 and len(values) > 2 * smooth
        panels.append(Panel(key, steps, values, smooth if dense else 0))
    return panels


WIDTH_IN, PANEL_IN = 8.0, 2.6  # the figure's width and each panel's height, inches
# Fixed margins, inches: room for tick labels of up to ~8 characters on the left, each panel's title above it and
# the step axis below the last. Laying them out per figure (tight_layout) drew every figure twice: ~40 % of its time.
LEFT_IN, RIGHT_IN, TOP_IN, BOTTOM_IN, GAP_IN = 0.85, 0.2, 0.35, 0.55, 0.45


def _margins(n_panels: int) -> dict[str, float]:
    """The gridspec fractions that give the margins above to a figure of `n_panels` panels."""
    height = PANEL_IN * n_panels
    axes_height = (height - TOP_IN - BOTTOM_IN - GAP_IN * (n_panels - 1)) / n_panels
    return {
        "left": LEFT_IN / WIDTH_IN,
        "right": 1 - RIGHT_IN / WIDTH_IN,
        "top": 1 - TOP_IN / height,
        "bottom": BOTTOM_IN / height,
        "hspace": GAP_IN / axes_height,
    }


def plot_metrics(
    rows: Sequence[Mapping[str, Any]],
    out_png: str | os.PathLike[str],
    keys: Sequence[str] = ("reward/mean", "val/reward/mean"),
    smooth: int = 5,
    skip_constant: bool = False,
) -> Path | None:
    """One subplot per panel of `plan_panels`; when there is none, nothing is written and None is returned."""
    # A bare Figure drawn by the Agg canvas: works headless, and unlike pyplot with matplotlib.use("Agg") it
    # neither switches the process-wide backend nor closes a notebook's open figures.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = plan_panels(rows, keys, smooth, skip_constant)
    if not panels:
        return None

    fig = Figure(figsize=(WIDTH_IN, PANEL_IN * len(panels)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, gridspec_kw=_margins(len(panels)))
    for ax, panel in zip(axes[:, 0], panels):
        if panel.smooth:
            ax.plot(panel.steps, panel.values, color="tab:blue", alpha=0.35, linewidth=0.8, label="each step")
            smoothed = moving_average(panel.values, panel.smooth)
            label = f"trailing mean of {panel.smooth} steps"
            ax.plot(panel.steps, smoothed, color="tab:blue", linewidth=2.0, label=label)
        else:
            label = "each validation" if panel.key.startswith("val/") else "each step"
            ax.plot(panel.steps, panel.values, color="tab:blue", linewidth=1.2, marker="o", markersize=4, label=label)
        ax.set_title(panel.key, y=1.0)  # a set height: matplotlib skips measuring every panel to place it
        ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    path = Path(out_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    with naming(path):
        fig.savefig(path, dpi=100)
    return path
