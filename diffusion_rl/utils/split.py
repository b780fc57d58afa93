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


def chunks_of_shares(n: int, owners: int, parts: int) -> list[list[int]]:
    """Rows 0 … n − 1, owned in `owners` contiguous shares (`split_evenly`), cut into `parts` chunks of which each
    holds an even piece of every share: every owner samples in every chunk. One owner: `parts` contiguous pieces."""
    pieces = [split_evenly(share, parts) for share in split_evenly(range(n), owners)]
    return [[row for share in pieces for row in share[c]] for c in range(parts)]
