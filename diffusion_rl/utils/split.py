"""Cutting a batch into pieces for chunks, workers or actors."""

from __future__ import annotations

from collections.abc import Sequence


def split_evenly(items: Sequence, parts: int) -> list[list]:
    """`items` cut into `parts` contiguous pieces whose lengths differ by at most one (the first ones longer);
    some are empty when there are fewer items than parts."""
    if parts < 1:
        raise ValueError(f"split_evenly needs at least one part, got {parts}")
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out
