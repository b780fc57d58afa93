"""Metrics declared once: how each metric reduces over an update's passes (micro-batch chunks) and over the workers.

The component that computes a metric declares, beside the code, how it reduces when it is not a plain mean
(`declare_metrics`): `max` and `min` keep the extreme (a ratio's range, the largest log-prob drift), `rows` weighs
each pass by the rows it covered (shares of a pass's entries, e.g. rollout correction's rejected fraction). Every
metric not declared here is the mean of the reports that have it, so a plugin that reports means declares nothing.
A declared name may end in `*` for a family of names (`rollout_corr/rejected_fraction/*`). A name is declared
once: a second, different rule for it raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MEAN, MAX, MIN, ROWS = "mean", "max", "min", "rows"
RULES: dict[str, str] = {}  # metric name (or prefix*) → MAX, MIN or ROWS; the table every reduction reads


def declare_metrics(rules: dict[str, str]) -> None:
    """Declare how the metrics `rules` names reduce (MEAN, MAX, MIN or ROWS); a name keeps one rule."""
    for name, rule in rules.items():
        if rule not in (MEAN, MAX, MIN, ROWS):
            raise ValueError(f"metric '{name}': unknown reduction '{rule}' (mean, max, min or rows)")
        if RULES.setdefault(name, rule) != rule:
            raise ValueError(f"metric '{name}' is declared twice, as {RULES[name]} and as {rule}")


def rule_of(name: str) -> str:
    """How metric `name` reduces: its declared rule, its family's (`prefix*`), else the mean."""
    if name in RULES:
        return RULES[name]
    return next((rule for key, rule in RULES.items() if key.endswith("*") and name.startswith(key[:-1])), MEAN)


def reduce_metrics(reports: Sequence[dict[str, float]], rows: Sequence[int] | None = None) -> dict[str, float]:
    """One metrics dict from reports of the same metrics (an update's passes; the Ray engine's workers), each over
    the reports that have the key, by its declared rule; `rows`: the rows each report covers (ROWS metrics are
    weighted by them; without, every report weighs alike). Tensor values become floats here, in one host read per
    device (`as_floats`)."""
    reports = as_floats(reports)
    out = {}
    for name in dict.fromkeys(key for report in reports for key in report):
        have = [i for i, report in enumerate(reports) if name in report]
        v = [reports[i][name] for i in have]
        rule = rule_of(name)
        if rule == MAX:
            out[name] = max(v)
        elif rule == MIN:
            out[name] = min(v)
        elif rule == ROWS and rows is not None:
            out[name] = sum(x * rows[i] for x, i in zip(v, have)) / sum(rows[i] for i in have)
        else:
            out[name] = sum(v) / len(v)
    return out


def as_floats(reports: Sequence[dict]) -> list[dict[str, float]]:
    """`reports` with every value a Python float, each equal to `float(value)`: the one-element tensors of each
    device read back together (one `.tolist()` of their float64 stack, which holds every float32, bfloat16 and
    float16 value, and integers to 2**53, exactly), so an update's metrics cost the device one synchronisation
    instead of one per metric and pass."""
    tensors: dict[torch.device, list[torch.Tensor]] = {}
    for report in reports:
        for value in report.values():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(value.device, []).append(value.detach().reshape(()).double())
    read = {device: iter(torch.stack(values).tolist()) for device, values in tensors.items()}
    return [
        {name: next(read[v.device]) if isinstance(v, torch.Tensor) else float(v) for name, v in report.items()}
        for report in reports
    ]
