"""What an evaluation compares: the base model (`base`) and training checkpoints, each one named column."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diffusion_rl.checkpoint.manifest import verify_checkpoint
from diffusion_rl.checkpoint.paths import resolve_checkpoint, step_of
from diffusion_rl.checkpoint.state import check_format
from diffusion_rl.errors import UserError

BASE = "base"


@dataclass(frozen=True)
class Target:
    name: str  # column name in tables and the folder of its images under the output directory
    checkpoint: Path | None  # None: the base model as loaded from --model
    step: int | None

    @property
    def is_base(self) -> bool:
        return self.checkpoint is None


def _checkpoint(spec: str) -> Path:
    directory = resolve_checkpoint(spec)
    verify_checkpoint(directory)  # every checkpoint before the first is sampled
    check_format(directory)
    return directory


def resolve_targets(specs: list[str]) -> list[Target]:
    """Columns for `--checkpoint` values in the order given; none given means the base model alone.

    Columns are named `base` and after the checkpoint directory (`step_000050`); two checkpoints of the same
    step from different runs get their run directory's name in front (`runA_step_000050`).
    """
    if not specs:
        return [Target(BASE, None, None)]
    resolved = [None if s == BASE else _checkpoint(s) for s in specs]
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
