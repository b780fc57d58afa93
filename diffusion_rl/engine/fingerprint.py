"""Weights that really change: a cheap fingerprint of a set of tensors, compared before and after an optimizer step
and before and after a rollout actor loads pushed weights.

A sync or an update that silently does nothing (a LoRA sync that loaded into nothing left a run's reward flat for
its whole length: verl-omni #552) shows no error; it shows weights that stay bit-for-bit what they were. The
fingerprint of tensors t is three float64 sums over all their entries (and over every shard, through `reduce`):

    Σ t_i,   Σ (−1)^i t_i (i the entry's position in its flattened tensor),   Σ t_i²

An update that changes any entry changes at least one of them but for changes that cancel exactly in all three
(e.g. a permutation of equal-norm entries within one sign class: not what an optimizer or a load does). The
alternating sum keeps a small change visible where Σ t² would lose it in rounding: its change grows like
√N·|Δ| while the sum itself grows like √N·|t|, where Σ t² changes by ~2√N·|t|·|Δ| out of N·|t|².
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


@torch.no_grad()
def fingerprint(tensors: Iterable[torch.Tensor], reduce: Callable[[float], float] = float) -> tuple[float, ...]:
    """(Σ t, Σ (−1)^i t, Σ t²) over the entries of `tensors` (a DTensor: its local shard, then `reduce` sums the
    workers' values)."""
    from torch.distributed.tensor import DTensor

    parts = []
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        flat = local.detach().reshape(-1).to(torch.float64)
        parts.append(torch.stack([flat.sum(), flat[0::2].sum() - flat[1::2].sum(), flat.square().sum()]))
    sums = torch.stack(parts).sum(0).cpu() if parts else torch.zeros(3, dtype=torch.float64)  # one host sync
    return tuple(reduce(float(v)) for v in sums)
