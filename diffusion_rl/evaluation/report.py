"""`diffusion-rl report RUN_DIR`: plots and a short markdown summary of a run, from its metrics.jsonl alone.

Writes into `<run_dir>/report/` (or `out`):
    reward.png       training reward (and each reward's mean when there are several)
    validation.png   validation reward mean and best@n
    policy.png       approx. KL to the rollout policy, KL to the reference, clip fraction, grad norm, loss
    timing.png       seconds per phase (generate, reward, advantage, update, checkpoint, validate, …) per step
    report.md        best validation step, first and final numbers, wall time split by phase
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from diffusion_rl.checkpoint.paths import CHECKPOINTS_DIR, step_dir_name
from diffusion_rl.evaluation.summary import markdown_table
from diffusion_rl.tracking import plot_metrics, read_metrics

REPORT_DIR = "report"
POLICY_KEYS = ("approx_kl", "kl_ref", "kl", "clip_fraction", "grad_norm", "loss")
SUMMARY_KEYS = (
    "reward/mean",
    "val/reward/mean",
    "val/reward/best@n",
    "loss",
    "approx_kl",
    "kl_ref",
    "clip_fraction",
    "grad_norm",
    "images_per_second",
)


def _values(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row with a finite number under `key`, in step order."""
    out = []
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out.append((int(row["step"]), float(value)))
    return sorted(out)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.6g}"


def timing_split(rows: Sequence[Mapping[str, Any]]) -> tuple[float, dict[str, float]]:
    """Total of timing/step, and the seconds of each phase summed over the steps ('other' = the rest)."""
    total = sum(v for _, v in _values(rows, "timing/step"))
    phases: dict[str, float] = {}
    for key in sorted({k for row in rows for k in row if k.startswith("timing/") and k != "timing/step"}):
        phases[key.removeprefix("timing/")] = sum(v for _, v in _values(rows, key))
    if total > 0:
        phases["other"] = max(0.0, total - sum(phases.values()))
    return total, phases


def plot_timing(rows: Sequence[Mapping[str, Any]], out_png: Path) -> Path | None:
    """Stacked bars: seconds of each phase at each step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = sorted({k for row in rows for k in row if k.startswith("timing/") and k != "timing/step"})
    steps = sorted({int(r["step"]) for r in rows if any(k in r for k in keys)})
    if not keys or not steps:
        return None
    index = {s: i for i, s in enumerate(steps)}
    fig = Figure(figsize=(8, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    bottom = np.zeros(len(steps))
    for key in keys:
        heights = np.zeros(len(steps))
        for step, value in _values(rows, key):
            heights[index[step]] += value
        ax.bar(steps, heights, bottom=bottom, width=0.9, label=key.removeprefix("timing/"))
        bottom += heights
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("time per phase")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def _summary_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    table = []
    for key in SUMMARY_KEYS:
        points = _values(rows, key)
        if not points:
            continue
        values = [v for _, v in points]
        last_tenth = values[-max(1, len(values) // 10) :]
        table.append(
            [
                key,
                _fmt(values[0]),
                _fmt(values[-1]),
                _fmt(float(np.mean(last_tenth))),
                _fmt(min(values)),
                _fmt(max(values)),
            ]
        )
    return table


def write_report(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Write the plots and report.md for the run in `run_dir`; returns the path of report.md."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out = Path(out) if out is not None else run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)

    per_reward = sorted(
        {k for r in rows for k in r if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2}
        - {k for r in rows for k in r if k.startswith("reward/source/")}
    )
    plots = {
        "reward": plot_metrics(rows, out / "reward.png", ["reward/mean", *(per_reward if len(per_reward) > 1 else [])]),
        "validation": plot_metrics(rows, out / "validation.png", ["val/reward/mean", "val/reward/best@n"], smooth=1),
        "policy": plot_metrics(rows, out / "policy.png", POLICY_KEYS),
        "timing": plot_timing(rows, out / "timing.png"),
    }

    steps = [int(r["step"]) for r in rows]
    lines = [f"# Run report: {run_dir}", ""]
    lines.append(f"{len(rows)} metrics rows, steps {min(steps)} to {max(steps)}." if rows else "No metrics rows.")
    lines.append("")

    val = _values(rows, "val/reward/mean")
    if val:
        best_step, best = max(val, key=lambda point: point[1])
        checkpoint = run_dir / CHECKPOINTS_DIR / step_dir_name(best_step)
        where = f" (checkpoint `{checkpoint}`)" if checkpoint.is_dir() else " (no checkpoint of that step is kept)"
        lines += [
            "## Best validation step",
            "",
            f"Step {best_step}: val/reward/mean {best:.6g}{where}; "
            f"first: {val[0][1]:.6g} at step {val[0][0]}, last: {val[-1][1]:.6g} at step {val[-1][0]}.",
            "",
        ]

    summary = _summary_rows(rows)
    if summary:
        header = ["metric", "first", "final", "mean of last 10%", "min", "max"]
        lines += ["## Numbers", "", markdown_table(header, summary)]

    total, phases = timing_split(rows)
    if total > 0:
        split = [[phase, f"{seconds:.1f}", f"{100 * seconds / total:.1f}%"] for phase, seconds in phases.items()]
        lines += [
            "## Wall time",
            "",
            f"{total:.1f} s over {len(_values(rows, 'timing/step'))} logged steps "
            f"({total / max(1, len(_values(rows, 'timing/step'))):.2f} s/step).",
            "",
            markdown_table(["phase", "seconds", "share"], split),
        ]

    shown = [f"![{name}]({path.name})" for name, path in plots.items() if path is not None]
    if shown:
        lines += ["## Plots", "", *shown, ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
