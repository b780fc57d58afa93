"""Where checkpoints are: names, steps, and what a path a user gives (`run.resume`, `--checkpoint`) points to.

A leaf module (no torch, nothing of ours but errors), used by the trainer, `eval`, `export` and
`sample --checkpoint` alike. Layout of a run directory:

    <run_dir>/checkpoints/step_000010/    one complete checkpoint (see checkpoint/state.py for its contents)
    <run_dir>/checkpoints/latest          text file holding the newest checkpoint's directory name

A checkpoint is read only inside its run: the checkpoints/ folder, `latest` and a step_NNNNNN directory are never
followed as symbolic links (nor is anything inside a checkpoint: checkpoint/manifest.py), so a link cannot make a
run read another run's checkpoint or a file elsewhere on the machine.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from diffusion_rl.errors import UserError

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
STEP_DIR = re.compile(r"step_(\d+)")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(path: str | os.PathLike[str]) -> int:
    """The step of a checkpoint directory from its name (`step_000010` -> 10)."""
    match = STEP_DIR.fullmatch(Path(path).name)
    if match is None:
        raise UserError(f"{path} is not a checkpoint directory: its name should be step_NNNNNN")
    return int(match.group(1))


def refuse_link(path: Path) -> None:
    """A UserError when `path` is a symbolic link: a checkpoint is read only inside its run directory."""
    if path.is_symlink():
        raise UserError(
            f"{path} is a symbolic link (to {os.readlink(path)}): a checkpoint is read only inside its run "
            "directory; replace the link with the directory it names"
        )


def list_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """The `step_*` directories under `checkpoints_dir` as (step, path), oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for entry in checkpoints_dir.iterdir():
        match = STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The checkpoint `latest` points to; the highest step when the pointer is missing or stale; else None."""
    pointer = checkpoints_dir / LATEST_FILE
    if pointer.is_symlink():
        logger.warning("%s is a symbolic link, not followed; using the highest step", pointer)
    elif pointer.is_file():
        name = pointer.read_text(encoding="utf-8").strip()
        target = checkpoints_dir / name
        if STEP_DIR.fullmatch(name) and target.is_dir():
            return target
        logger.warning("%s names %r, which is not a checkpoint here; using the highest step", pointer, name[:80])
    found = list_checkpoints(checkpoints_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(spec: str | os.PathLike[str], what: str = "--checkpoint") -> Path:
    """The checkpoint directory a user means by `spec`: a step_NNNNNN directory itself, a run directory (its latest
    checkpoint) or its checkpoints/ folder. `what` names the option in errors (e.g. run.resume)."""
    path = Path(spec).expanduser()
    if not str(spec) or not path.exists():
        raise UserError(f"{what} {spec}: no such directory (give a step_NNNNNN checkpoint or a run directory)")
    if path.is_dir() and STEP_DIR.fullmatch(path.name):
        refuse_link(path)
        return path.resolve()
    if path.is_dir() and (path / CHECKPOINTS_DIR).is_dir():
        run_dir = path
    elif path.is_dir() and path.name == CHECKPOINTS_DIR:
        run_dir = path.parent
    else:
        raise UserError(
            f"{what} {spec}: not a checkpoint: expected a step_NNNNNN directory or a run directory with a "
            f"{CHECKPOINTS_DIR}/ folder"
        )
    refuse_link(run_dir / CHECKPOINTS_DIR)
    latest = latest_checkpoint(run_dir / CHECKPOINTS_DIR)
    if latest is None:
        raise UserError(f"{what} {spec}: {run_dir / CHECKPOINTS_DIR} holds no checkpoint yet")
    refuse_link(latest)
    return latest.resolve()
