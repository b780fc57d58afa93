"""The guard's statistics over a run, with their allowed ranges and alerts, as one PNG (for `diffusion-rl report`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diffusion_rl.config.guard import ALL_STATS
from diffusion_rl.tracking.plots import metric_series
from diffusion_rl.utils.files import naming

LABELS = {
    "brightness": "brightness (mean luma / 255)",
    "dark_fraction": "dark pixel fraction (luma < 16)",
    "saturated_fraction": "saturated pixel fraction (a channel ≥ 250)",
    "colorfulness": "colourfulness (Hasler–Süsstrunk)",
    "edge_density": "edge density",
    "jpeg_kb": "JPEG size, kB (quality 95)",
    "group_diversity": "within-group diversity (mean |Δpixel| / 255)",
    "val_drift": "validation drift from the reference images (mean |Δpixel| / 255)",
}


def plot_guard(
    rows: Sequence[Mapping[str, Any]],
    summary: Mapping[str, Any] | None,
    alerts: Sequence[Mapping[str, Any]],
    out_png: str | os.PathLike[str],
) -> Path | None:
    """One panel per logged guard statistic: its values, the baseline and allowed band (or the cap), and the
    steps where it was out of range (red crosses). None when no guard statistic was logged."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = {s: metric_series(rows, f"guard/{s}") for s in ALL_STATS}
    series = {s: data for s, data in series.items() if len(data[0])}
    if not series:
        return None
    stats_info = (summary or {}).get("stats", {})
    ncols = 2 if len(series) > 1 else 1
    nrows = -(-len(series) // ncols)
    fig = Figure(figsize=(6.2 * ncols, 2.6 * nrows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, (stat, (steps, values)) in zip(axes.flat, series.items()):
        ax.plot(steps, values, color="tab:blue", linewidth=1.2, marker="o", markersize=3, label="value")
        info = stats_info.get(stat, {})
        baseline, allowed, cap = info.get("baseline"), info.get("allowed_change"), info.get("max")
        if baseline is not None:
            ax.axhline(baseline, color="tab:green", linewidth=1.2, linestyle="--", label="baseline")
            if allowed is not None:
                lo, hi = max(0.0, baseline - allowed), baseline + allowed  # every statistic is ≥ 0
                ax.axhspan(lo, hi, color="tab:green", alpha=0.12, label="allowed range")
        if cap is not None:
            ax.axhline(cap, color="tab:red", linewidth=1.2, linestyle="--", label="max allowed")
        bad = [(a["step"], a["value"]) for a in alerts if a.get("stat") == stat]
        if bad:
            x, y = zip(*bad)
            ax.plot(x, y, linestyle="none", marker="x", color="tab:red", markersize=9, mew=2, label="out of range")
        ax.set_title(LABELS.get(stat, stat), fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.legend(loc="best", fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(series) :]:
        ax.set_visible(False)
    fig.tight_layout()
    path = Path(out_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    with naming(path):
        fig.savefig(path, dpi=100)
    return path
