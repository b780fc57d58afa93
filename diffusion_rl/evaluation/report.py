"""`diffusion-rl report RUN_DIR`: plots, a markdown summary and an HTML page of a run.

Reads metrics.jsonl (required), and when present guard/ (the reward-hacking guard's alerts and thresholds),
samples/step_*/ (per-image validation files), rollouts/ and config.yaml. Writes into `<run_dir>/report/` (or `out`):
    reward.png       training reward (and each reward's mean when there are several): each step, and a trailing
                     mean labelled as such
    validation.png   validation reward mean and best@n, each validation as measured (no smoothing)
    before_after.png the first and the last validation's images of the first prompts, with their rewards
    guard.png        the guard's statistics with their baselines, allowed ranges and alerts
    policy.png       approx. KL to the rollout policy, KL to the reference, clip fraction, grad norm, loss; a
                     quantity that is 0 throughout (e.g. the clip fraction of an on-policy run) gets no panel
    algorithm.png    the update's relative weight change, the share of groups whose rewards did not spread (no
                     advantage), and the algorithm's own metrics (its loss's prefixes: `LossSpec.metric_prefixes`)
    timing.png       seconds per phase (generate, reward, prepare, update, checkpoint, validate, …) per step
    report.md        best validation step, guard alerts, first and final numbers, wall time split by phase
    report.html      all of the above on one self-contained page, with the validation images of each prompt across
                     steps and the latest rollouts (evaluation/html_report.py)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from diffusion_rl.checkpoint.paths import CHECKPOINTS_DIR, step_dir_name
from diffusion_rl.evaluation.before_after import plot_before_after
from diffusion_rl.evaluation.html_report import ReportData, alert_summary, load_guard_files, write_html
from diffusion_rl.evaluation.summary import markdown_table
from diffusion_rl.guard.plots import plot_guard
from diffusion_rl.tracking import plot_metrics, read_metrics
from diffusion_rl.tracking.plots import constant_value, metric_series, plan_panels
from diffusion_rl.utils.files import naming

REPORT_DIR = "report"
POLICY_KEYS = ("approx_kl", "kl_ref", "kl", "clip_fraction", "grad_norm", "loss")
UPDATE_KEYS = ("train/weight_change_rel", "advantage/zero_std_group_fraction")
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
    steps, values = metric_series(rows, key)
    return [(int(step), float(value)) for step, value in zip(steps, values)]


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
    fig = Figure(figsize=(9, 3.5))
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
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # beside the bars, never over them
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    with naming(out_png):
        fig.savefig(out_png, dpi=100)
    return out_png


def algorithm_keys(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """UPDATE_KEYS, then every logged metric under a registered loss's own prefix (`awm/…`, `dppo/…`), sorted; not
    one whose series is a policy panel's already (AWM's policy loss is the loss when it has no KL)."""
    from diffusion_rl.config.plugins import LOSSES

    prefixes = {prefix for _, spec in LOSSES.items() for prefix in spec.metric_prefixes}
    own = sorted({k for row in rows for k in row if k.partition("/")[0] in prefixes})
    drawn = [metric_series(rows, key) for key in POLICY_KEYS]
    repeats = {k for k in own if any(_same(metric_series(rows, k), series) for series in drawn)}
    return [*UPDATE_KEYS, *(k for k in own if k not in repeats)]


def _same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    return len(a[0]) > 0 and all(np.array_equal(x, y) for x, y in zip(a, b))


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


def zero_loss_note(rows: Sequence[Mapping[str, Any]], scale: float = 1e-6) -> str | None:
    """A line for a loss that stays within ±`scale` of 0 at every step, which reads as "nothing trains" and is the
    rule for an on-policy policy-gradient loss; None otherwise."""
    largest = max((abs(v) for _, v in _values(rows, "loss")), default=None)
    if largest is None or largest >= scale:
        return None
    return (f"loss stays within ±{largest:.1e} of 0: on-policy the ratio is 1 and the group's "
            "advantages have mean 0, so the loss is ~0 by construction; its gradient, not its value, trains "
            "(grad_norm).")  # fmt: skip


def write_report(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Write the plots, report.md and report.html for the run in `run_dir`; returns the path of report.md."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out = Path(out) if out is not None else run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    guard_summary, guard_alerts = load_guard_files(run_dir)

    per_reward = sorted(
        {k for r in rows for k in r if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2}
        - {k for r in rows for k in r if k.startswith("reward/source/")}
    )
    update_keys = [*POLICY_KEYS, *algorithm_keys(rows)]
    drawn_policy = [p.key for p in plan_panels(rows, update_keys, skip_constant=True)]
    logged_policy = [p.key for p in plan_panels(rows, update_keys)]
    plots = {
        "reward": plot_metrics(rows, out / "reward.png", ["reward/mean", *(per_reward if len(per_reward) > 1 else [])]),
        "validation": plot_metrics(rows, out / "validation.png", ["val/reward/mean", "val/reward/best@n"]),
        "before_after": plot_before_after(run_dir / "samples", out / "before_after.png"),
        "guard": plot_guard(rows, guard_summary, guard_alerts, out / "guard.png"),
        "policy": plot_metrics(rows, out / "policy.png", POLICY_KEYS, skip_constant=True),
        "algorithm": plot_metrics(rows, out / "algorithm.png", update_keys[len(POLICY_KEYS) :], skip_constant=True),
        "timing": plot_timing(rows, out / "timing.png"),
    }

    steps = [int(r["step"]) for r in rows]
    lines = [f"# Run report: {run_dir}", ""]
    lines.append(f"{len(rows)} metrics rows, steps {min(steps)} to {max(steps)}." if rows else "No metrics rows.")
    lines.append("")

    best_val = None
    val = _values(rows, "val/reward/mean")
    if val:
        best_step, best = max(val, key=lambda point: point[1])
        checkpoint = run_dir / CHECKPOINTS_DIR / step_dir_name(best_step)
        where = f"checkpoint `{checkpoint}`" if checkpoint.is_dir() else "no checkpoint of that step is kept"
        best_val = (best_step, best, where.replace("`", ""))
        lines += [
            "## Best validation step",
            "",
            f"Step {best_step}: val/reward/mean {best:.6g} ({where}); "
            f"first: {val[0][1]:.6g} at step {val[0][0]}, last: {val[-1][1]:.6g} at step {val[-1][0]}.",
            "",
        ]

    if guard_alerts:
        header = ["statistic", "alerts", "first step", "last step", "furthest value", "baseline", "rule"]
        table = [[r["stat"], str(r["alerts"]), str(r["first"]), str(r["last"]), _fmt(r["furthest"]),
                  _fmt(r["baseline"]), r["rule"]] for r in alert_summary(guard_alerts)]  # fmt: skip
        outcome = (guard_summary or {}).get("outcome")
        lines += ["## Guard alerts", "", *([outcome, ""] if outcome else []), markdown_table(header, table), ""]
        lines += ["Every alert: guard/alerts.jsonl (and report.html).", ""]

    summary = _summary_rows(rows)
    if summary:
        header = ["metric", "first", "final", "mean of last 10%", "min", "max"]
        lines += ["## Numbers", "", markdown_table(header, summary)]

    total, phases = timing_split(rows)
    n_timed = len(_values(rows, "timing/step"))
    if total > 0:
        split = [[phase, f"{seconds:.1f}", f"{100 * seconds / total:.1f}%"] for phase, seconds in phases.items()]
        lines += [
            "## Wall time",
            "",
            f"{total:.1f} s over {n_timed} logged steps ({total / max(1, n_timed):.2f} s/step).",
            "",
            markdown_table(["phase", "seconds", "share"], split),
        ]

    shown = [f"![{name}]({path.name})" for name, path in plots.items() if path is not None]
    if shown:
        lines += ["## Plots", "", *shown, ""]
    omitted = [f"{k} {constant_value(rows, k):g}" for k in logged_policy if k not in drawn_policy]
    if omitted:
        lines += [f"Not drawn (the same at every step): {', '.join(omitted)}.", ""]
    loss_note = zero_loss_note(rows) if "loss" in drawn_policy else None
    if loss_note:
        lines += [loss_note, ""]
    lines += ["The same on one page, with validation images and rollouts: report.html.", ""]
    path = out / "report.md"
    with naming(path):
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    data = ReportData(
        run_dir=run_dir,
        rows=rows,
        plots=plots,
        best_val=best_val,
        omitted_policy=omitted,
        loss_note=loss_note,
        timing_total=total,
        timing_phases=phases,
        timing_steps=n_timed,
        guard_summary=guard_summary,
        guard_alerts=guard_alerts,
    )
    write_html(data, out / "report.html")
    return path
