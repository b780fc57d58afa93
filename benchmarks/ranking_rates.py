"""The ranking's learning-rate selection: the --lrs rates, a log grid grown past an end while the best rate is there.

An algorithm's rate is the one with the highest selection reward (training reward over each run's last third,
averaged over the selection seeds; ranking_table.choose_lr). A rate chosen at an end of its grid may only say that
the grid stopped too early (the first ranking's 7 of 12 algorithms chose an end of their three rates), so the grid
grows by one rate past that end, at the grid's own factor, and the selection runs again there, until the best rate
has a neighbour on both sides or `max_extensions` rates were added (then the table says the choice is at an end).
"""

from __future__ import annotations

import sys

RATIO_TOLERANCE = 0.02  # rates are rounded to 3 significant digits (they name files): ×3 steps differ by < 0.2 %


def rounded(rate: float) -> float:
    """3 significant digits: the form rates take in file names and the table."""
    return float(f"{rate:.3g}")


def grid_centre(path, cfg) -> float:
    """The rate an algorithm's grid is laid around: the task's train.lr (after --set), but for a config that keeps
    its LoRA adapters where the task fine-tunes every weight (TDM-R1 trains three), its own config's train.lr: an
    adapter's rate sits ~100× above a full fine-tune's, out of reach of a grid around the other's."""
    from diffusion_rl.config import load

    return load(str(path)).train.lr if cfg.model.lora.enabled else cfg.train.lr


def parse_lrs(spec: str, base: float) -> list[float]:
    """'/3,x1,x3,1e-4' → rates: an 'x' token multiplies the config's rate, a '/' token divides it, a number is a
    rate; 3 significant digits (they name the result files)."""
    rates = []
    for token in (t.strip() for t in spec.split(",") if t.strip()):
        if token[0] in "x/":
            rate = base * float(token[1:]) if token[0] == "x" else base / float(token[1:])
        else:
            rate = float(token)
        rates.append(rounded(rate))
    if len(set(rates)) != len(rates):
        sys.exit(f"--lrs {spec}: the rates {rates} repeat")
    return rates


def log_factor(rates: list[float]) -> float:
    """The common ratio of a log grid of ≥ 2 rates (ascending after sorting); a grid with unequal steps or fewer
    than 2 rates cannot be extended at its own spacing: a ValueError naming the rates."""
    ordered = sorted(rates)
    if len(ordered) < 2 or ordered[0] <= 0:
        raise ValueError(f"the rates {rates} are not a log grid: give ≥ 2 positive rates")
    ratios = [b / a for a, b in zip(ordered, ordered[1:])]
    if max(ratios) > min(ratios) * (1 + RATIO_TOLERANCE):
        raise ValueError(f"the rates {ordered} are not a log grid (ratios {[round(r, 3) for r in ratios]})")
    return sum(ratios) / len(ratios)


def selection_grid(
    initial: list[float], means: dict[float, float | None], max_extensions: int
) -> tuple[list[float], bool]:
    """(the rates to run, whether the grid is final). `means`: the selection reward of each rate whose runs have
    finished on every selection seed (None: they all failed, e.g. diverged; such a rate is never the best). The grid
    is final when every rate in it has finished and the best one is inside it, or when max_extensions rates have
    been added; until then it is the rates to run next (the initial grid, plus those added so far)."""
    rates = sorted(rounded(r) for r in initial)
    if not max_extensions or len(rates) < 2:
        return rates, True  # a grid that cannot grow is final as given
    factor = log_factor(rates)
    added = 0
    while True:
        if any(rate not in means for rate in rates):
            return rates, False  # runs still to finish at this grid
        scored = [rate for rate in rates if means[rate] is not None]
        if not scored:
            return rates, True  # every rate failed: nothing to extend towards
        best = max(scored, key=lambda rate: means[rate])
        if added >= max_extensions or best not in (rates[0], rates[-1]):
            return rates, True
        if best == rates[0]:
            rates.insert(0, rounded(rates[0] / factor))
        else:
            rates.append(rounded(rates[-1] * factor))
        added += 1


def at_an_end(chosen: float | None, rates: list[float]) -> bool:
    """Whether the chosen rate is the lowest or highest of the rates run (the table flags it: not bracketed)."""
    return chosen is not None and len(rates) > 1 and chosen in (min(rates), max(rates))
