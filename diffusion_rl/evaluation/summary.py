"""Statistics of K scored samples per prompt, and the side-by-side table that compares evaluated models.

For one reward with scores s[p, k] (prompt p, sample k; NaN where the reward failed on that sample):
    mean@K  mean of every finite s[p, k]
    best@K  mean over prompts of max_k s[p, k] (prompts whose K samples all failed are left out)
    std     standard deviation (ddof 0) of every finite s[p, k]
A statistic over no finite score is None (JSON null; "n/a" in tables), never 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def score_stats(scores_PK: np.ndarray) -> dict[str, Any]:
    """mean@K, best@K, std, scored and failed counts of one reward's scores [prompts, K]."""
    scores_PK = np.asarray(scores_PK, dtype=np.float64)
    k = scores_PK.shape[1]
    ok = np.isfinite(scores_PK)
    flat = scores_PK[ok]
    has_any = ok.any(axis=1)
    best = np.where(ok, scores_PK, -np.inf).max(axis=1)[has_any]
    return {
        f"mean@{k}": float(flat.mean()) if flat.size else None,
        f"best@{k}": float(best.mean()) if best.size else None,
        "std": float(flat.std()) if flat.size else None,
        "scored": int(ok.sum()),
        "failed": int((~ok).sum()),
    }


def reward_stats(scores_PK: np.ndarray, sources_P: Sequence[str]) -> dict[str, Any]:
    """score_stats over all prompts, plus `per_source` (data_source → score_stats of its prompts)."""
    stats = score_stats(scores_PK)
    sources = np.asarray(sources_P)
    stats["per_source"] = {str(s): score_stats(scores_PK[sources == s]) for s in sorted(set(sources_P))}
    return stats


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.6g}"


def comparison_rows(columns: Sequence[Mapping[str, Any]], k: int) -> list[list[str]]:
    """Table rows [metric, value per column]: per reward mean@K, best@K, std (and failed when any failed);
    then the same per data source when the prompts come from more than one source."""
    rewards = list(columns[0]["rewards"])
    rows: list[list[str]] = []

    def add(label: str, pick) -> None:
        rows.append([label, *(_fmt(pick(c)) for c in columns)])

    for name in rewards:
        for stat in (f"mean@{k}", f"best@{k}", "std"):
            add(f"{name} {stat}", lambda c, n=name, s=stat: c["rewards"][n][s])
        if any(c["rewards"][name]["failed"] for c in columns):
            add(f"{name} failed", lambda c, n=name: c["rewards"][n]["failed"])
    sources = list(columns[0]["rewards"][rewards[0]]["per_source"])
    if len(sources) > 1:
        for name in rewards:
            for source in sources:
                for stat in (f"mean@{k}", f"best@{k}"):
                    add(
                        f"{name} [{source}] {stat}",
                        lambda c, n=name, s=source, t=stat: c["rewards"][n]["per_source"][s][t],
                    )
    return rows


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-style markdown table whose columns are padded to line up in plain text too."""
    table = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(r, widths)) + " |" for r in table]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines) + "\n"


def comparison_table(columns: Sequence[Mapping[str, Any]], k: int) -> str:
    """The markdown table comparing evaluated models (one column each) on every reward statistic."""
    return markdown_table(["metric", *(c["name"] for c in columns)], comparison_rows(columns, k))
