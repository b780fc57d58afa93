"""What an evaluation compares: the base model (`base`) and training checkpoints, each one named column."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from diffusion_rl.errors import UserError
from diffusion_rl.models.checkpoint_weights import WEIGHTS_FILE
from diffusion_rl.trainer.checkpoint import CHECKPOINTS_DIR, CheckpointManager, step_of

BASE = "base"
_STEP_DIR = re.compile(r"step_\d+")


@dataclass(frozen=True)
class Target:
    name: str  # column name in tables and the folder of its images under the output directory
    checkpoint: Path | None  # None: the base model as loaded from --model
    step: int | None

    @property
    def is_base(self) -> bool:
        return self.checkpoint is None


def resolve_checkpoint(spec: str) -> Path:
    """A checkpoint directory from a step_NNNNNN directory, a run directory (its latest) or its checkpoints/."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise UserError(f"--checkpoint {spec}: no such directory (give `base`, a step_NNNNNN checkpoint or a run dir)")
    if _STEP_DIR.fullmatch(path.name):
        if not (path / WEIGHTS_FILE).is_file():
            raise UserError(f"--checkpoint {spec}: {path} has no {WEIGHTS_FILE}; is it a complete checkpoint?")
        return path.resolve()
    run_dir = path.parent if path.name == CHECKPOINTS_DIR else path
    if not (run_dir / CHECKPOINTS_DIR).is_dir():
        raise UserError(
            f"--checkpoint {spec}: not a checkpoint: expected `base`, a step_NNNNNN directory, or a run directory "
            f"with a {CHECKPOINTS_DIR}/ folder"
        )
    latest = CheckpointManager(run_dir).latest()
    if latest is None:
        raise UserError(f"--checkpoint {spec}: {run_dir / CHECKPOINTS_DIR} holds no checkpoint yet")
    return latest.resolve()


def resolve_targets(specs: list[str]) -> list[Target]:
    """Columns for `--checkpoint` values in the order given; none given means the base model alone.

    Columns are named `base` and after the checkpoint directory (`step_000050`); two checkpoints of the same
    step from different runs get their run directory's name in front (`runA_step_000050`).
    """
    if not specs:
        return [Target(BASE, None, None)]
    resolved = [None if s == BASE else resolve_checkpoint(s) for s in specs]
    seen: dict[Path | None, str] = {}
    for spec, path in zip(specs, resolved):
        if path in seen:
            raise UserError(f"--checkpoint {spec} names the same model as --checkpoint {seen[path]}; give it once")
        seen[path] = spec
    names = [p.name if p is not None else BASE for p in resolved]
    targets = []
    for path, name in zip(resolved, names):
        if path is None:
            targets.append(Target(BASE, None, None))
            continue
        if names.count(name) > 1 or name == BASE:
            name = f"{path.parent.parent.name}_{name}"
        targets.append(Target(name, path, step_of(path)))
    if len({t.name for t in targets}) != len(targets):
        raise UserError(f"--checkpoint values give clashing column names {[t.name for t in targets]}; rename a run")
    return targets
