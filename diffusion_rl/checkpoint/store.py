"""Checkpoint directories that are either complete or absent, with a `latest` pointer and pruning.

Layout:
    <run_dir>/checkpoints/step_000010/    one complete checkpoint (contents are up to the caller's write_fn, and
                                          manifest.sha256, the sha256 of each of its files: checkpoint/manifest.py)
    <run_dir>/checkpoints/latest          text file holding the newest checkpoint's directory name
    <run_dir>/checkpoints/.tmp-*          work in progress, pruned checkpoints being deleted, or leftovers of a
                                          crash: never listed, removed by save()
    <run_dir>/checkpoints/broken-step_*   a checkpoint whose weights sampled nothing but NaN: kept, never listed

Invariant: a `step_*` directory only ever appears by an atomic rename of a fully written, hashed and fsynced temp
directory, and only ever disappears by an atomic rename out of the `step_*` names (then it is deleted), so every
`step_*` directory is complete. One process (the driver) saves at a time.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from diffusion_rl.checkpoint.manifest import write_manifest
from diffusion_rl.checkpoint.paths import (
    CHECKPOINTS_DIR,
    LATEST_FILE,
    STEP_DIR,
    latest_checkpoint,
    list_checkpoints,
    refuse_link,
    resolve_checkpoint,
    step_dir_name,
)
from diffusion_rl.utils.files import new_folder_beside, refuse_file_in_the_way, set_aside

logger = logging.getLogger(__name__)

EARLIER_RUN = (CHECKPOINTS_DIR, "config.yaml", "metrics.jsonl")  # any of these in a run directory: a run was here
TMP_PREFIX = ".tmp-"
BROKEN_PREFIX = "broken-"  # a checkpoint set aside as broken: not a step_* name, so never listed


def _fsync_path(path: Path, directory: bool = False) -> None:
    if directory and os.name != "posix":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under root, so the rename that publishes it cannot outrun the data."""
    for folder, _, files in os.walk(root):
        for name in files:
            file = Path(folder) / name
            if not file.is_symlink():
                _fsync_path(file)
        _fsync_path(Path(folder), directory=True)


def rename_into_place(tmp: Path, final: Path, aside: Path) -> None:
    """Make the finished directory `tmp` become `final`, replacing what is there: a rename cannot replace a
    non-empty directory, so an existing `final` is first moved to `aside`, then removed."""
    if final.exists():
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)


# what torch.save's writer says when the file system takes fewer bytes than it wrote (a full disk)
_SHORT_WRITE = ("unexpected pos", "iostream error", "file write failed")


def _short_write(error: BaseException, checkpoint: Path) -> OSError | None:
    """A write that stopped part-way as the OSError it almost always is, ENOSPC, naming the checkpoint and the
    space left; None for any other error. torch.save says so as a RuntimeError ("unexpected pos 704 vs 598"), and
    torch.distributed.checkpoint wraps whatever its writer raised in a CheckpointException per rank."""
    failures = getattr(error, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if isinstance(failures, dict):
        for wrapped in failures.values():
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            found = _short_write(inner, checkpoint) if isinstance(inner, BaseException) else None
            if found is not None:
                return found
        return None
    free = shutil.disk_usage(checkpoint.parent).free / 2**20
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return OSError(errno.ENOSPC, f"No space left on device ({free:.0f} MiB free now)", str(checkpoint))
    said = [line.strip() for line in str(error).splitlines() if any(s in line for s in _SHORT_WRITE)]
    if not isinstance(error, RuntimeError) or not said:  # (a Ray worker's error holds its traceback: one line)
        return None
    return OSError(
        errno.ENOSPC,
        f"No space left on device ({free:.0f} MiB free now; torch.save stopped part-way: {said[0]})",
        str(checkpoint),
    )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class CheckpointManager:
    """Saves, finds and prunes the checkpoints of one run directory.

    keep_last: how many of the newest checkpoints to keep; <= 0 keeps all.
    """

    def __init__(self, run_dir: str | os.PathLike[str], keep_last: int = 0) -> None:
        self.run_dir = Path(run_dir)
        refuse_file_in_the_way(self.run_dir, "run.dir")
        self.dir = self.run_dir / CHECKPOINTS_DIR
        refuse_link(self.dir)  # its checkpoints would be refused when read: set run.dir on the other volume instead
        self.keep_last = keep_last

    def save(self, step: int, write_fn: Callable[[Path], None]) -> Path:
        """Has write_fn fill a temp dir, hashes its files into its manifest, publishes it as step_NNNNNN, points
        `latest` at it, prunes old ones.

        If write_fn raises, its temp dir is removed, `latest` and existing checkpoints are untouched, and the
        error propagates (a full disk as an ENOSPC OSError naming the checkpoint). An existing checkpoint of the
        same step is replaced.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        name = step_dir_name(step)
        tmp = self.dir / f"{TMP_PREFIX}{name}-{os.getpid()}"
        tmp.mkdir()
        try:
            write_fn(tmp)  # returns when every file is complete (under Ray: every worker's shards)
            write_manifest(tmp)
            _fsync_tree(tmp)
        except BaseException as e:
            short_write = _short_write(e, self.dir / name)
            shutil.rmtree(tmp, ignore_errors=True)
            if short_write is not None:
                raise short_write from e
            raise

        final = self.dir / name
        # A crash between the two renames leaves no step_ dir for this step (latest() then falls back to the
        # previous one) and the old copy under .tmp-, removed by the next save.
        rename_into_place(tmp, final, aside=self.dir / f"{TMP_PREFIX}old-{name}-{os.getpid()}")
        _fsync_path(self.dir, directory=True)
        self._write_latest(name)
        self._prune(keep=final)
        logger.info("saved checkpoint %s", final)
        return final

    def list(self) -> list[tuple[int, Path]]:
        """The complete checkpoints as (step, path), oldest first. Temp dirs are never listed."""
        return list_checkpoints(self.dir)

    def latest(self) -> Path | None:
        """The checkpoint `latest` points to; the highest step when the pointer is missing or stale; else None."""
        return latest_checkpoint(self.dir)

    def resolve_resume(self, resume: str) -> Path | None:
        """The checkpoint to resume from for `run.resume`, or None for a fresh start.

        "never": None. "auto": latest() of this run (None when there is none). Anything else is a path: a
        checkpoint directory (step_NNNNNN), a run directory (its latest checkpoint) or its checkpoints/ folder.
        """
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest()
        return resolve_checkpoint(resume, what="run.resume")

    def set_aside_earlier_run(self) -> Path | None:
        """run.resume=never: an earlier run in this run directory (its checkpoints, config.yaml or metrics) is moved
        aside, into `<run.dir>.before-<time>` beside it, with one log line, so the fresh run's steps are the only
        ones here (`sample --checkpoint` and `latest` would otherwise find the old run's). Returns where; None when
        no run was there."""
        if not any((self.run_dir / name).exists() for name in EARLIER_RUN):
            return None
        aside = set_aside(self.run_dir)
        logger.warning("run.resume=never: the earlier run in %s is moved aside to %s (delete it when no longer needed)",
                       self.run_dir, aside)  # fmt: skip
        return aside

    def set_aside_later(self, step: int) -> Path | None:
        """A resume from step `step` of a run directory that holds later checkpoints (an earlier one resumed on
        purpose): those, which the resumed run's saves would replace, move into `<run.dir>.after-step_NNNNNN-<time>`
        beside it, with a copy of metrics.jsonl (the resumed run drops its rows after `step`), and `latest` stops
        naming them; one log line. Returns that folder; None when no checkpoint is later."""
        later = [path for s, path in self.list() if s > step]
        if not later:
            return None
        aside = new_folder_beside(self.run_dir.resolve(), f"after-{step_dir_name(step)}")
        (aside / CHECKPOINTS_DIR).mkdir()
        for path in later:
            os.rename(path, aside / CHECKPOINTS_DIR / path.name)
        for name in ("metrics.jsonl", "config.yaml"):
            if (self.run_dir / name).is_file():
                shutil.copy2(self.run_dir / name, aside / name)
        self._point_latest_at_newest()
        logger.warning("resuming from step %d: the later checkpoints of %s (%s) and a copy of its metrics are moved "
                       "aside to %s, which this run's saves would replace (delete it when no longer needed)",
                       step, self.run_dir, ", ".join(p.name for p in later), aside)  # fmt: skip
        return aside

    def point_latest_at(self, checkpoint: Path) -> None:
        """Make `latest` name `checkpoint` (one of this run's), e.g. after the guard rolled the run back to it."""
        if Path(checkpoint).parent.resolve() != self.dir.resolve() or not STEP_DIR.fullmatch(Path(checkpoint).name):
            raise ValueError(f"{checkpoint} is not a checkpoint of {self.dir}")
        self._write_latest(Path(checkpoint).name)

    def set_aside_latest(self) -> tuple[Path, Path | None]:
        """Rename the latest checkpoint, known to be broken (its weights sample NaN), out of the step_* names to
        broken-step_* (kept to inspect, never resumed from or pruned) and point `latest` at the one before it.
        Returns (where the broken one is now, the new latest or None)."""
        current = self.latest()
        if current is None:
            raise ValueError(f"{self.dir} holds no checkpoint to set aside")
        aside = self.dir / f"{BROKEN_PREFIX}{current.name}"
        rename_into_place(current, aside, aside=self.dir / f"{TMP_PREFIX}{aside.name}-{os.getpid()}")
        _fsync_path(self.dir, directory=True)
        self._point_latest_at_newest()
        return aside, self.latest()

    def _point_latest_at_newest(self) -> None:
        """`latest` names the newest complete checkpoint, or is gone when none is left."""
        found = self.list()
        if found:
            self._write_latest(found[-1][1].name)
        else:
            (self.dir / LATEST_FILE).unlink(missing_ok=True)

    def _write_latest(self, name: str) -> None:
        tmp = self.dir / f"{TMP_PREFIX}{LATEST_FILE}-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as file:
            file.write(name + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, self.dir / LATEST_FILE)
        _fsync_path(self.dir, directory=True)

    def _remove_leftovers(self) -> None:
        for entry in self.dir.iterdir():
            if entry.name.startswith(TMP_PREFIX):
                logger.warning("removing %s, left by an interrupted save", entry)
                _remove(entry)

    def _prune(self, keep: Path) -> None:
        """Delete all but the newest keep_last checkpoints: each is first renamed out of the step_* names (atomic),
        so a kill mid-delete leaves a .tmp- folder for the next save to remove, never a partial step_*."""
        if self.keep_last <= 0:
            return
        found = self.list()
        for _, path in found[: max(0, len(found) - self.keep_last)]:
            if path != keep:
                # out of the step_* namespace in one rename first: a kill mid-delete leaves a .tmp- leftover that
                # the next save removes, never an incomplete step_* directory
                doomed = self.dir / f"{TMP_PREFIX}pruned-{path.name}-{os.getpid()}"
                os.rename(path, doomed)
                _fsync_path(self.dir, directory=True)
                try:
                    shutil.rmtree(doomed)
                except OSError as e:  # the checkpoint just saved is complete: don't fail the run for a leftover
                    logger.warning("could not remove the pruned %s (%s); the next save retries", doomed, e)
