"""`report.html`: one self-contained page (no server, no network; every image inlined as a data URI).

Sections, in order (each a <section id=...>, listed in the page's navigation):
    summary      steps, best validation step, the guard's outcome
    rewards      training reward (each step, and a labelled trailing mean) and validation reward (each validation)
    guard        the guard's statistics with their baseline, allowed range and alerts; a table of the alerts
    validation   for each validation prompt, its images at every validated step side by side (fixed seeds: the
                 same sample of a prompt in every column), with their rewards
    rollouts     the latest rollout dumps: each group's images with reward and advantage, as text
    policy       KL, clip fraction, grad norm, loss (a metric the same at every step is left out, and named)
    timing       seconds per phase, summed over the run, and per step
    config       the run's config.yaml
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffusion_rl.tracking.val_images import read_validation_images
from diffusion_rl.utils.files import naming
from diffusion_rl.utils.json_input import json_lines

MAX_ROLLOUT_DUMPS = 3  # the latest dumps shown (a sheet of 16 images each); the others are named
MAX_VAL_STEPS = 12  # validation columns shown per prompt (spread over the run, first and last always)

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; margin: 0; color: #1d1d1f;
       background: #fafafa; font-size: 15px; line-height: 1.45; }
header { background: #1f3a5f; color: white; padding: 14px 28px; }
header h1 { margin: 0; font-size: 22px; } header p { margin: 4px 0 0; opacity: .85; font-size: 13px; }
nav { position: sticky; top: 0; background: #e9eef5; padding: 8px 28px; border-bottom: 1px solid #cfd8e3; z-index: 1; }
nav a { margin-right: 16px; color: #1f3a5f; text-decoration: none; font-weight: 600; }
main { padding: 8px 28px 40px; max-width: 1400px; }
section { background: white; border: 1px solid #dde3ea; border-radius: 6px; padding: 6px 20px 16px; margin: 18px 0; }
h2 { font-size: 19px; border-bottom: 2px solid #e9eef5; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 16px 0 6px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 14px; }
th, td { border: 1px solid #d5dbe3; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f2f5f9; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.plot { max-width: 100%; border: 1px solid #eee; }
.strip { overflow-x: auto; }
.strip td.cell { text-align: center; }
td.prompt { max-width: 260px; font-weight: 600; }
.tile { image-rendering: pixelated; width: 112px; height: auto; display: block; margin: 2px auto; }
.cap { font-size: 12px; color: #444; font-variant-numeric: tabular-nums; white-space: nowrap; }
.pos { color: #1c6b2a; } .neg { color: #a40000; }
.alert { color: #a40000; font-weight: 600; }
.ok { color: #1c6b2a; font-weight: 600; }
.note { color: #555; font-size: 13px; }
pre { background: #f6f8fa; padding: 10px; overflow-x: auto; font-size: 13px; border: 1px solid #e1e4e8; }
"""


@dataclass
class ReportData:
    """Everything the page shows; gathered by evaluation/report.py."""

    run_dir: Path
    rows: list[dict[str, Any]]
    plots: dict[str, Path | None]  # reward, validation, before_after, guard, policy, timing
    best_val: tuple[int, float, str] | None = None  # step, value, checkpoint note
    omitted_policy: list[str] = field(default_factory=list)
    loss_note: str | None = None  # a loss ~0 by construction (report.zero_loss_note)
    timing_total: float = 0.0
    timing_phases: dict[str, float] = field(default_factory=dict)
    timing_steps: int = 0
    guard_summary: dict[str, Any] | None = None
    guard_alerts: list[dict[str, Any]] = field(default_factory=list)


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.4g}" if isinstance(value, float) else _esc(value)


MIME_TYPES = {".png": "image/png", ".webp": "image/webp", ".gif": "image/gif"}  # animated WebP/GIF: videos


def data_uri(path: str | os.PathLike[str]) -> str:
    mime = MIME_TYPES.get(Path(path).suffix.lower(), "image/png")
    return f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def _img(path: Path, alt: str, css: str = "plot") -> str:
    return f'<img class="{css}" alt="{_esc(alt)}" src="{data_uri(path)}">'


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = ()) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = "".join(f"<td{' class=num' if i in numeric else ''}>{cell}</td>" for i, cell in enumerate(row))
        body.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{anchor}"><h2>{_esc(title)}</h2>{body}</section>'


# ---- sections -----------------------------------------------------------------------------------------------


def _summary(d: ReportData) -> str:
    steps = [int(r["step"]) for r in d.rows]
    items = [f"<li>{len(d.rows)} metrics rows, steps {min(steps)} to {max(steps)}.</li>"] if steps else []
    if d.best_val:
        step, value, note = d.best_val
        items.append(f"<li>Best validation reward: <b>{value:.6g}</b> at step {step} ({_esc(note)}).</li>")
    outcome = (d.guard_summary or {}).get("outcome")
    if d.guard_alerts:
        first = d.guard_alerts[0]
        items.append(
            f'<li class="alert">Guard: {len(d.guard_alerts)} alert(s); first: {_esc(first["stat"])} at step '
            f"{first['step']}. {_esc(outcome or '')}</li>"
        )
    elif d.guard_summary is not None:
        items.append('<li class="ok">Guard: every watched statistic stayed in range.</li>')
    return _section("summary", "Summary", f"<ul>{''.join(items)}</ul>")


def _rewards(d: ReportData) -> str:
    parts = []
    if d.plots.get("reward"):
        parts.append("<h3>Training reward</h3>" + _img(d.plots["reward"], "training reward"))
    if d.plots.get("validation"):
        parts.append(
            "<h3>Validation reward</h3>"
            '<p class="note">Every validation is drawn as it was measured, without smoothing.</p>'
            + _img(d.plots["validation"], "validation reward")
        )
    if d.plots.get("before_after"):
        parts.append(
            "<h3>First and last validation</h3>"
            "<p class=\"note\">The same prompts and seeds: each prompt's first sample, captioned with the prompt's "
            "mean reward over its samples.</p>" + _img(d.plots["before_after"], "first and last validation")
        )
    return _section("rewards", "Rewards", "".join(parts) or '<p class="note">No reward was logged.</p>')


def _guard(d: ReportData) -> str:
    if d.guard_summary is None and not d.plots.get("guard"):
        return _section("guard", "Reward-hacking guard", '<p class="note">The guard was off for this run.</p>')
    s = d.guard_summary or {}
    parts = [
        f'<p class="note">Statistics of the sampled images that no reward optimises. Baseline: the mean of the '
        f"first {s.get('baseline_steps', '?')} training steps; out of range when the change from it exceeds "
        f"{_num(s.get('max_relative_change'))} × |baseline| + a noise floor (the shaded band). Action: "
        f"<b>{_esc(s.get('action', '?'))}</b>.</p>"
    ]
    if s.get("outcome"):
        parts.append(f'<p class="alert">{_esc(s["outcome"])}</p>')
    if d.guard_alerts:
        rows = [
            [f'<span class="alert">{_esc(r["stat"])}</span>', str(r["alerts"]), str(r["first"]), str(r["last"]),
             _num(r["furthest"]), _num(r["baseline"]), _esc(r["rule"])]
            for r in alert_summary(d.guard_alerts)
        ]  # fmt: skip
        header = ["statistic", "alerts", "first step", "last step", "furthest value", "baseline", "rule"]
        parts.append(_table(header, rows, numeric=(1, 2, 3, 4, 5)))
        every = [
            [str(a["step"]), _esc(a["stat"]), _num(a["value"]), _num(a["baseline"]), _esc(a["rule"]),
             _num(a["threshold"])]
            for a in d.guard_alerts
        ]  # fmt: skip
        table = _table(["step", "statistic", "value", "baseline", "rule", "allowed"], every, numeric=(0, 2, 3, 5))
        parts.append(f"<details><summary>every alert ({len(every)})</summary>{table}</details>")
    else:
        parts.append('<p class="ok">No statistic left its range.</p>')
    stats = s.get("stats", {})
    if stats:
        rows = [
            [_esc(name), _num(info.get("baseline")), _num(info.get("allowed_change")), _num(info.get("max"))]
            for name, info in stats.items()
        ]
        header = ["statistic", "baseline", "allowed change", "max"]
        parts.append("<h3>Thresholds</h3>" + _table(header, rows, (1, 2, 3)))
    if d.plots.get("guard"):
        parts.append(_img(d.plots["guard"], "guard statistics"))
    return _section("guard", "Reward-hacking guard", "".join(parts))


def _spread(steps: list[int], most: int) -> list[int]:
    """Up to `most` of the steps, evenly spread, the first and last always kept."""
    if len(steps) <= most:
        return steps
    picks = {steps[round(i * (len(steps) - 1) / (most - 1))] for i in range(most)}
    return sorted(picks)


def _validation(d: ReportData) -> str:
    by_step = read_validation_images(d.run_dir / "samples")
    if not by_step:
        samples = d.run_dir / "samples"
        grids = sorted(g for g in samples.glob("step_*") if g.suffix in MIME_TYPES) if samples.is_dir() else []
        if not grids:
            return _section("validation", "Validation images", '<p class="note">No validation images.</p>')
        body = "".join(f"<h3>{_esc(g.stem)}</h3>{_img(g, g.stem)}" for g in grids[-3:])
        note = '<p class="note">This run has no per-image validation files; its latest grids:</p>'
        return _section("validation", "Validation images", note + body)
    steps = _spread(sorted(by_step), MAX_VAL_STEPS)
    prompts: dict[int, str] = {}
    for rows in by_step.values():
        for row in rows:
            prompts.setdefault(row["prompt_index"], row["prompt"])
    shown = f" Showing {len(steps)} of {len(by_step)} validations." if len(steps) < len(by_step) else ""
    note = (
        '<p class="note">One row per validation prompt, one column per validated step (step 0: the model before '
        "training). The seeds are fixed: the k-th image of a cell is the same sample in every column. Under each "
        f"image: its validation reward.{shown}</p>"
    )
    sources: dict[int, list[Path]] = {}  # an edit's source images, the same at every step: the first written
    for rows in by_step.values():
        for row in rows:
            if row["source_paths"]:
                sources.setdefault(row["prompt_index"], row["source_paths"])
    body = []
    for p, prompt in sorted(prompts.items()):
        cells = [f'<td class="prompt">{_esc(prompt)}</td>']
        if sources:
            tiles = "".join(_img(path, f"source {j}", "tile") for j, path in enumerate(sources.get(p, [])))
            cells.append(f'<td class="cell">{tiles}</td>')
        for step in steps:
            images = sorted((r for r in by_step[step] if r["prompt_index"] == p), key=lambda r: r["sample"])
            tiles = "".join(
                _img(r["path"], f"step {step}, sample {r['sample']}", "tile")
                + f'<div class="cap">r {_num(r["reward"])}</div>'
                for r in images
            )
            cells.append(f'<td class="cell">{tiles}</td>')
        body.append(f"<tr>{''.join(cells)}</tr>")
    header = "<th>prompt</th>" + ("<th>source</th>" if sources else "") + "".join(f"<th>step {s}</th>" for s in steps)
    table = f'<div class="strip"><table><thead><tr>{header}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
    return _section("validation", "Validation images", note + table)


def _rollouts(d: ReportData) -> str:
    root = d.run_dir / "rollouts"
    dumps = sorted(p for p in root.glob("step_*") if (p / "rollout.jsonl").is_file()) if root.is_dir() else []
    if not dumps:
        note = '<p class="note">No rollout dumps (set log.rollout_every to write them).</p>'
        return _section("rollouts", "Rollouts", note)
    parts = []
    if len(dumps) > MAX_ROLLOUT_DUMPS:
        older = ", ".join(p.name for p in dumps[:-MAX_ROLLOUT_DUMPS])
        parts.append(f'<p class="note">Latest {MAX_ROLLOUT_DUMPS} of {len(dumps)} dumps; older: {_esc(older)}.</p>')
    parts.insert(0, '<p class="note">Training samples as the policy drew them: r = reward, A = advantage.</p>')
    for folder in dumps[-MAX_ROLLOUT_DUMPS:]:
        rows = [row for _, row in json_lines(folder / "rollout.jsonl", ("group",)) if row is not None]
        parts.append(f"<h3>Step {int(folder.name.removeprefix('step_'))}</h3>")
        groups: dict[int, list[dict[str, Any]]] = {}
        for row in rows:
            groups.setdefault(row["group"], []).append(row)
        table_rows = []
        for group, members in groups.items():
            cells = []
            for m in members:
                image = _img(folder / m["image"], f"sample {m['index']}", "tile") if m["image"] else "(not kept)"
                status = ' <span class="alert">failed</span>' if m["failed"] else ""
                advantage = m["advantage"]
                sign = "pos" if advantage is not None and advantage > 0 else "neg" if advantage else ""
                a_text = "n/a" if advantage is None else f"{advantage:+.2f}"
                caption = f'r {_num(m["reward"])} · <span class="{sign}">A {a_text}</span>{status}'
                cells.append(f'<td class="cell">{image}<div class="cap">{caption}</div></td>')
            prompt = f'<td class="prompt">{_esc(members[0]["prompt"])}</td>'
            table_rows.append(f"<tr><td>{group}</td>{prompt}{''.join(cells)}</tr>")
        width = max(len(m) for m in groups.values())
        header = "".join(f"<th>{h}</th>" for h in ["group", "prompt", *(f"sample {i}" for i in range(width))])
        table = f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(table_rows)}</tbody></table>"
        parts.append(f'<div class="strip">{table}</div>')
    return _section("rollouts", "Rollouts", "".join(parts))


def _policy(d: ReportData) -> str:
    parts = []
    if d.plots.get("policy"):
        parts.append(_img(d.plots["policy"], "policy statistics"))
    if d.plots.get("algorithm"):
        parts.append(_img(d.plots["algorithm"], "the update's size and the algorithm's own metrics"))
    if d.omitted_policy:
        parts.append(
            f'<p class="note">Not drawn, the same at every step: {_esc(", ".join(d.omitted_policy))} (an on-policy run '
            "has ratio 1: no clipping, no KL to the rollout policy).</p>"
        )
    if d.loss_note:
        parts.append(f'<p class="note">{_esc(d.loss_note)}</p>')
    return _section("policy", "Policy", "".join(parts) or '<p class="note">Nothing logged.</p>')


def _timing(d: ReportData) -> str:
    if d.timing_total <= 0:
        return _section("timing", "Timing", '<p class="note">No timing was logged.</p>')
    rows = [
        [_esc(phase), f"{seconds:.1f}", f"{100 * seconds / d.timing_total:.1f}%"]
        for phase, seconds in sorted(d.timing_phases.items(), key=lambda kv: -kv[1])
    ]
    per_step = d.timing_total / max(1, d.timing_steps)
    intro = f"<p>{d.timing_total:.1f} s over {d.timing_steps} logged steps ({per_step:.2f} s/step).</p>"
    plot = _img(d.plots["timing"], "time per phase") if d.plots.get("timing") else ""
    return _section("timing", "Timing", intro + _table(["phase", "seconds", "share"], rows, (1, 2)) + plot)


def _config(d: ReportData) -> str:
    path = d.run_dir / "config.yaml"
    if not path.is_file():
        return _section("config", "Config", '<p class="note">No config.yaml in the run directory.</p>')
    return _section("config", "Config", f"<pre>{_esc(path.read_text(encoding='utf-8'))}</pre>")


SECTIONS = (
    ("summary", "Summary", _summary),
    ("rewards", "Rewards", _rewards),
    ("guard", "Guard", _guard),
    ("validation", "Validation images", _validation),
    ("rollouts", "Rollouts", _rollouts),
    ("policy", "Policy", _policy),
    ("timing", "Timing", _timing),
    ("config", "Config", _config),
)


def write_html(data: ReportData, out_html: str | os.PathLike[str]) -> Path:
    """Write the page; returns its path."""
    nav = "".join(f'<a href="#{anchor}">{_esc(title)}</a>' for anchor, title, _ in SECTIONS)
    body = "".join(render(data) for _, _, render in SECTIONS)
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>Run report: {_esc(data.run_dir.name)}</title>"
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head><body>'
        f"<header><h1>Run report: {_esc(data.run_dir.name)}</h1><p>{_esc(data.run_dir)}</p></header>"
        f"<nav>{nav}</nav><main>{body}</main></body></html>\n"
    )
    path = Path(out_html)
    with naming(path):
        path.write_text(page, encoding="utf-8")
    return path


def alert_summary(alerts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per statistic, in order of first alert: count, first and last step, the value furthest from the baseline."""
    out: dict[str, dict[str, Any]] = {}
    for a in alerts:
        row = out.setdefault(a["stat"], {"stat": a["stat"], "alerts": 0, "first": a["step"], "rule": a["rule"],
                                         "baseline": a["baseline"], "furthest": a["value"]})  # fmt: skip
        row["alerts"] += 1
        row["last"] = a["step"]
        reference = a["baseline"] if a["baseline"] is not None else 0.0
        if abs(a["value"] - reference) > abs(row["furthest"] - reference):
            row["furthest"] = a["value"]
    return list(out.values())


def load_guard_files(run_dir: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(guard/summary.json or None, the rows of guard/alerts.jsonl)."""
    from diffusion_rl.guard import ALERTS_FILE, GUARD_DIR, SUMMARY_FILE

    folder = run_dir / GUARD_DIR
    summary = json.loads((folder / SUMMARY_FILE).read_text()) if (folder / SUMMARY_FILE).is_file() else None
    alerts_file = folder / ALERTS_FILE
    keys = ("step", "stat", "value", "baseline", "rule", "threshold")  # what the report shows of an alert
    alerts = [row for _, row in json_lines(alerts_file, keys)] if alerts_file.is_file() else []
    alerts = [row for row in alerts if row is not None]
    return summary, alerts
