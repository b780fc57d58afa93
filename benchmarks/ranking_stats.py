"""Statistics of the ranked learning benchmark (benchmarks/learning.py): intervals over seeds, ranks with ties, bands.

- `t_critical(level, dof)`: the Student t value t* with P(|T| <= t*) = level for T ~ t(dof), from the closed-form
  CDF of an integer number of degrees of freedom (Abramowitz & Stegun 26.7.3/26.7.4), inverted by bisection;
  no scipy needed. t_critical(0.95, 4) = 2.776.
- `interval(values)`: mean ± t*(n−1) · sd / √n, sd with n − 1 in the denominator (the usual 95 % interval of a
  mean over seeds).
- `rank_with_ties(intervals)`: ranks by mean; an algorithm whose interval overlaps another's is not ranked apart
  from it, so each gets the range of ranks it could hold. Overlapping 95 % intervals is a conservative criterion
  (two means can differ significantly while their intervals still overlap a little); it says "not separated by
  this benchmark", never "equal".
- `band(curves, grid)`: each seed's validation curve interpolated linearly onto a common time grid, then the
  interval over seeds at every grid point.
- `validation_se(scores, per_prompt)`: the standard error of one validation point's mean reward, from its per-image
  scores.
- `paired_difference(values, reference)`: per seed value − the reference's at the same seed (same prompts, same
  validation images), and the interval of those differences: the seed-to-seed spread both share cancels.
- `rank_paired(values)`: ranks by mean; a is placed apart from b only where the paired interval of a − b excludes 0.
- `first_crossing(xs, ys, target)`: where a piecewise-linear curve first reaches a value.
- `compute_to_match(curves, reference_finals, grid)`: the compute at which an algorithm's mean curve over seeds first
  reaches the reference's final mean, with a paired bootstrap interval over seeds (`bootstrap_resamples`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def _t_two_sided_mass(t: float, dof: int) -> float:
    """P(|T| <= t) for T ~ Student t with an integer dof >= 1 (A&S 26.7.3 for odd dof, 26.7.4 for even)."""
    theta = math.atan(t / math.sqrt(dof))
    s, c = math.sin(theta), math.cos(theta)
    if dof % 2 == 0:  # sin θ · [1 + ½cos²θ + (1·3)/(2·4)cos⁴θ + … up to cos^(dof−2)θ]
        term, total = 1.0, 1.0
        for k in range(1, dof // 2):
            term *= (2 * k - 1) / (2 * k) * c * c
            total += term
        return s * total
    # odd: (2/π)·[θ + sin θ · (cos θ + (2/3)cos³θ + … up to cos^(dof−2)θ)], the bracket's sum empty for dof 1
    total = 0.0
    if dof > 1:
        term = c
        total = term
        for k in range(1, (dof - 1) // 2):
            term *= (2 * k) / (2 * k + 1) * c * c
            total += term
    return 2 / math.pi * (theta + s * total)


def t_critical(level: float, dof: int) -> float:
    """t* with P(|T| <= t*) = level for T ~ Student t(dof): the multiplier of a two-sided `level` interval."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if dof < 1 or int(dof) != dof:
        raise ValueError(f"dof must be a positive integer, got {dof}")
    low, high = 0.0, 1.0
    while _t_two_sided_mass(high, int(dof)) < level:
        high *= 2
    for _ in range(200):  # bisection to machine precision
        mid = (low + high) / 2
        if _t_two_sided_mass(mid, int(dof)) < level:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * high:
            break
    return (low + high) / 2


def interval(values: Sequence[float], level: float = 0.95) -> dict:
    """Mean ± Student-t interval of `values` (one per seed): mean, sd (n − 1), n, half_width, low, high.
    One value has no interval: half_width, low and high are None."""
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    n = int(x.size)
    if n == 0:
        return {"mean": None, "sd": None, "n": 0, "level": level, "half_width": None, "low": None, "high": None}
    mean = float(x.mean())
    if n == 1:
        return {"mean": mean, "sd": None, "n": 1, "level": level, "half_width": None, "low": None, "high": None}
    sd = float(x.std(ddof=1))
    half = t_critical(level, n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "sd": sd, "n": n, "level": level, "half_width": half, "low": mean - half,
            "high": mean + half}  # fmt: skip


def _bounds(iv: Mapping) -> tuple[float, float]:
    """(low, high); an interval of one seed is unbounded (it separates from nothing)."""
    if iv.get("low") is None:
        return -math.inf, math.inf
    return iv["low"], iv["high"]


def rank_with_ties(intervals: Mapping[str, Mapping]) -> dict[str, dict]:
    """name → {rank, best_rank, worst_rank, tied_with}: rank by mean (1 = highest); best_rank = 1 + the number of
    algorithms whose interval lies wholly above this one's, worst_rank = the number whose interval is not wholly
    below it (itself included); tied_with = the algorithms whose intervals overlap this one's. Names without a
    mean are left out."""
    named = {k: v for k, v in intervals.items() if v.get("mean") is not None}
    order = sorted(named, key=lambda k: -named[k]["mean"])
    out = {}
    for name in order:
        low, high = _bounds(named[name])
        above = [o for o in order if o != name and _bounds(named[o])[0] > high]
        below = [o for o in order if o != name and _bounds(named[o])[1] < low]
        tied = [o for o in order if o != name and o not in above and o not in below]
        out[name] = {"rank": order.index(name) + 1, "best_rank": 1 + len(above),
                     "worst_rank": len(order) - len(below), "tied_with": tied}  # fmt: skip
    return out


def rank_label(r: Mapping) -> str:
    """The rank as printed: "2" when separated from every other, "1–3" when its interval overlaps ranks 1 to 3."""
    best, worst = r["best_rank"], r["worst_rank"]
    return str(best) if best == worst else f"{best}–{worst}"


def common_grid(curves: Sequence[Sequence[tuple[float, float]]], points: int = 11) -> np.ndarray:
    """`points` evenly spaced times from 0 to the shortest curve's last time (every seed is observed there)."""
    end = min(c[-1][0] for c in curves)
    return np.linspace(0.0, end, points)


def band(curves: Sequence[Sequence[tuple[float, float]]], grid: Sequence[float], level: float = 0.95) -> list[dict]:
    """The interval over seeds at each grid time, each seed's (time, value) curve interpolated linearly there."""
    on_grid = [np.interp(grid, [t for t, _ in c], [v for _, v in c]) for c in curves]
    return [{"t": float(t), **interval([float(y[i]) for y in on_grid], level)} for i, t in enumerate(grid)]


def validation_se(scores: Sequence[float], per_prompt: int) -> dict:
    """Standard errors of a validation point's mean reward from its per-image scores, prompt-major (prompt p's
    samples at p·per_prompt … p·per_prompt + per_prompt − 1; NaN = a failed score, left out):
    se: sd(all scores, n − 1) / √N, images treated as independent draws — the one held to the target;
    se_within_prompts: √(Σ_p s²_p / n_p) / P, the noise of the seeds alone when the prompt set is fixed (it leaves
    out the between-prompt spread, so it is smaller; None when a prompt has fewer than 2 finite scores)."""
    x = np.asarray(scores, dtype=np.float64)
    finite = x[np.isfinite(x)]
    se = float(finite.std(ddof=1) / math.sqrt(finite.size)) if finite.size > 1 else None
    within = None
    if per_prompt > 1 and x.size % per_prompt == 0:
        rows = [r[np.isfinite(r)] for r in x.reshape(-1, per_prompt)]
        if all(r.size > 1 for r in rows):
            within = float(math.sqrt(sum(r.var(ddof=1) / r.size for r in rows)) / len(rows))
    sd = float(finite.std(ddof=1)) if finite.size > 1 else None
    return {"n": int(finite.size), "sd": sd, "se": se, "se_within_prompts": within}


def images_for_se(sd: float, target_se: float) -> int:
    """The number of independent images whose mean has standard error <= target_se, for a per-image sd."""
    return max(1, math.ceil((sd / target_se) ** 2))


def paired_difference(values: Mapping[int, float], reference: Mapping[int, float], level: float = 0.95) -> dict:
    """seed → value and seed → the reference's value: the interval of (value − reference) over the seeds both have,
    plus those seeds and differences."""
    seeds = sorted(set(values) & set(reference))
    diffs = [values[s] - reference[s] for s in seeds]
    return {**interval(diffs, level), "seeds": seeds, "differences": diffs}


def rank_paired(values: Mapping[str, Mapping[int, float]], level: float = 0.95) -> dict[str, dict]:
    """name → {seed → value}: name → {rank, best_rank, worst_rank, tied_with}. Rank by the mean over seeds (1 =
    highest); b is above a when the paired interval of b − a over their common seeds lies wholly above 0, below when
    wholly below; otherwise tied (fewer than 2 common seeds: tied). The ranks a name could hold are 1 + the number
    above it to the number not below it."""
    named = {k: v for k, v in values.items() if v}
    order = sorted(named, key=lambda k: -float(np.mean(list(named[k].values()))))
    out = {}
    for name in order:
        above, below = [], []
        for other in order:
            if other == name:
                continue
            d = paired_difference(named[other], named[name], level)
            if d["low"] is not None and d["low"] > 0:
                above.append(other)
            elif d["high"] is not None and d["high"] < 0:
                below.append(other)
        tied = [o for o in order if o != name and o not in above and o not in below]
        out[name] = {"rank": order.index(name) + 1, "best_rank": 1 + len(above),
                     "worst_rank": len(order) - len(below), "tied_with": tied}  # fmt: skip
    return out


def first_crossing(xs: Sequence[float], ys: Sequence[float], target: float) -> float | None:
    """The first x at which the curve through (xs, ys), linear between points, reaches `target` (≥); None if never."""
    if ys[0] >= target:
        return float(xs[0])
    for i in range(1, len(xs)):
        if ys[i] >= target:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return float(x0 + (target - y0) / (y1 - y0) * (x1 - x0))
    return None


def bootstrap_resamples(n: int, count: int = 2000, seed: int = 0) -> np.ndarray:
    """[count, n] indices drawn with replacement: which seeds each bootstrap replicate takes (fixed generator, so
    the table is the same every time it is recomputed)."""
    return np.random.default_rng(seed).integers(0, n, size=(count, n))


def compute_to_match(curves: Mapping[int, Sequence[float]], reference_finals: Mapping[int, float],
                     grid: Sequence[float], level: float = 0.95, resamples=None) -> dict:  # fmt: skip
    """curves: seed → the algorithm's validation reward at each `grid` compute; reference_finals: seed → the
    reference's final reward. The compute at which the mean curve over the common seeds first reaches the
    reference's final mean (first_crossing; None: not within the grid), and a paired bootstrap percentile interval:
    each replicate draws seeds with replacement and takes both means over the same draw; a replicate that never
    reaches its target counts as beyond the grid (inf). `resamples`: [count, n] seed positions (default
    bootstrap_resamples)."""
    seeds = sorted(set(curves) & set(reference_finals))
    if not seeds:
        return {"value": None, "low": None, "high": None, "seeds": []}
    ys = np.asarray([curves[s] for s in seeds], dtype=np.float64)
    finals = np.asarray([reference_finals[s] for s in seeds], dtype=np.float64)
    value = first_crossing(grid, ys.mean(axis=0), float(finals.mean()))
    if len(seeds) < 2:
        return {"value": value, "low": None, "high": None, "seeds": seeds}
    draws = bootstrap_resamples(len(seeds)) if resamples is None else np.asarray(resamples)
    reps = []
    for idx in draws:
        hit = first_crossing(grid, ys[idx].mean(axis=0), float(finals[idx].mean()))
        reps.append(math.inf if hit is None else hit)
    low, high = np.quantile(reps, [(1 - level) / 2, (1 + level) / 2], method="inverted_cdf")
    return {"value": value, "low": float(low), "high": float(high), "seeds": seeds, "replicates": len(reps)}
