"""Where a run's metrics and sample images go: JSONL, TensorBoard, W&B and the console, behind one interface."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diffusion_rl.errors import UserError, did_you_mean
from diffusion_rl.tracking.base import MultiTracker, Tracker
from diffusion_rl.tracking.console import ConsoleTracker
from diffusion_rl.tracking.images import image_grid, save_png
from diffusion_rl.tracking.jsonl import JsonlTracker, read_metrics
from diffusion_rl.tracking.plots import plot_metrics
from diffusion_rl.tracking.tensorboard import TensorBoardTracker
from diffusion_rl.tracking.wandb import WandbTracker

__all__ = [
    "ConsoleTracker",
    "JsonlTracker",
    "MultiTracker",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "image_grid",
    "make_trackers",
    "plot_metrics",
    "read_metrics",
    "save_png",
]

WANDB_KEYS = ("project", "name", "mode", "tags")


def make_trackers(
    run_dir: str | os.PathLike[str],
    *,
    jsonl: bool = True,
    tensorboard: bool = True,
    wandb: Mapping[str, Any] | None = None,
    console_every: int = 1,
    total_steps: int | None = None,
    config: Mapping[str, Any] | None = None,
    console_rewards: Sequence[tuple[str, str]] | None = None,
    console_early: bool = False,
) -> MultiTracker:
    """The run's trackers, all writing inside `run_dir`.

    wandb: None for no W&B, else keyword arguments of WandbTracker: `project` (required), `name` (default: the
    run directory's name), `mode` ("online" | "offline" | "disabled", default "online"), `tags`.
    console_every: log a console line every N steps (and at the first and the last, `total_steps`); 0 = none.
    config: the run's resolved config, recorded with the W&B run.
    console_rewards: (metric key, label) of the rewards the console line shows (default: the total, `reward/mean`).
    console_early: also a console line at the 2nd, 4th, 8th, … step before the first periodic one (no progress bar).
    """
    if console_every < 0:
        raise UserError(f"console_every={console_every}: use N >= 1 to log every N steps, or 0 for no console line")
    run_dir = Path(run_dir)
    trackers: list[Tracker] = []
    if jsonl:
        trackers.append(JsonlTracker(run_dir))
    if tensorboard:
        trackers.append(TensorBoardTracker(run_dir))
    if console_every > 0:
        trackers.append(
            ConsoleTracker(every=console_every, total_steps=total_steps, rewards=console_rewards, early=console_early)
        )
    if wandb is not None:
        unknown = [key for key in wandb if key not in WANDB_KEYS]
        if unknown:
            key = unknown[0]
            raise UserError(
                f"unknown wandb option {key!r}{did_you_mean(key, WANDB_KEYS)}; valid: {', '.join(WANDB_KEYS)}"
            )
        if not wandb.get("project"):
            raise UserError("wandb logging needs a project name (wandb.project)")
        options = {"name": run_dir.name, **wandb}
        try:
            trackers.append(WandbTracker(run_dir=run_dir, config=config, **options))
        except BaseException:
            MultiTracker(trackers).close()  # don't leave the files opened above dangling
            raise
    return MultiTracker(trackers)
