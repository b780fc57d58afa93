"""The rollouts a worker sampled and keeps, by training step, until the update that trains them.

A step's batch may be sampled in several calls (score chunks); its rows are kept in the order they were made, and
positions in that order name them (`rows`, `export`). Several steps may be kept at once when rollouts run ahead of
the update (engine.max_staleness > 0); `release(step)` forgets one. Thread-safe: a rollout actor exports rows of
one step while it samples the next.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from diffusion_rl.sampling.trajectory import Trajectory


class KeptRollouts:
    def __init__(self):
        self._by_step: dict[int, list[Trajectory]] = {}
        self._lock = threading.Lock()

    def add(self, step: int, traj: Trajectory) -> None:
        with self._lock:
            self._by_step.setdefault(step, []).append(traj)

    def rows(self, step: int, positions: Sequence[int] | None = None) -> Trajectory:
        """The step's kept rows (all, or those at `positions`, in that order)."""
        with self._lock:
            parts = self._by_step.get(step)
            if not parts:
                raise RuntimeError(f"no trajectories of step {step} are kept here (kept: {sorted(self._by_step)})")
            traj = torch.cat(parts) if len(parts) > 1 else parts[0]
            if len(parts) > 1:
                self._by_step[step] = [traj]  # concatenated once
        if positions is None:
            return traj
        return traj[torch.tensor(list(positions), dtype=torch.long, device=traj.device)]

    def export(self, step: int, positions: Sequence[int]) -> Trajectory:
        """CPU copies of rows that another worker trains on."""
        return self.rows(step, positions).cpu()

    def release(self, step: int) -> None:
        with self._lock:
            self._by_step.pop(step, None)

    def keep_only(self, steps: Sequence[int]) -> None:
        """Forget every step but `steps` (what an interrupted step left behind)."""
        with self._lock:
            self._by_step = {s: parts for s, parts in self._by_step.items() if s in steps}

    @property
    def steps(self) -> list[int]:
        with self._lock:
            return sorted(self._by_step)
