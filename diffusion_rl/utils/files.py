"""Writes that name their file when they fail, and a folder's contents set aside before a fresh start in it."""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def naming(path: str | os.PathLike[str]) -> Iterator[None]:
    """Give an OSError raised inside without a file name (PIL's or matplotlib's writer, a full disk mid-write)
    `path` as its file name, so the one-line error says which write failed (cli.py prints the file name)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), os.fspath(path)) from e


def refuse_file_in_the_way(directory: str | os.PathLike[str], what: str) -> None:
    """A UserError when the folder `directory`, or the nearest of its parents that exists, is a file: `what` (the
    key or flag that names it) could not be written there. Before any work, rather than mkdir's error at the end."""
    from diffusion_rl.errors import UserError

    directory = Path(directory)
    existing = next((p for p in (directory, *directory.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UserError(f"{what} {directory}: {existing} is a file, not a folder; give {what} a folder")


def set_aside(directory: str | os.PathLike[str]) -> Path:
    """Move everything in `directory` into a new folder beside it, `<name>.before-<YYYYmmdd-HHMMSS>` (`-2`, … when
    taken), and return that folder: a fresh start in `directory` then finds it empty and loses nothing. The directory
    itself stays (it may be a mount point); one that holds the working directory is refused (a UserError)."""
    from diffusion_rl.errors import UserError

    directory = Path(directory).resolve()
    if Path.cwd().resolve().is_relative_to(directory):
        raise UserError(f"{directory} holds the working directory: a run there cannot start over; give it a folder")
    aside = new_folder_beside(directory, "before")
    for entry in sorted(directory.iterdir()):
        os.rename(entry, aside / entry.name)
    return aside


def new_folder_beside(directory: Path, label: str) -> Path:
    """A new empty folder `<name>.<label>-<YYYYmmdd-HHMMSS>` beside `directory` (`-2`, … when taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        folder = directory.with_name(f"{directory.name}.{label}-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def refuse_same_file(command: str, **paths: str | os.PathLike[str] | None) -> None:
    """A UserError when two of `paths` (role → path; None skipped) name one file: writing one would lose the other."""
    from diffusion_rl.errors import UserError

    seen: dict[Path, str] = {}
    for role, path in paths.items():
        if path is None:
            continue
        key = Path(path).expanduser().resolve()
        if key in seen:
            raise UserError(f"{command}: the {seen[key]} and the {role} are one file ({path}); give the {role} "
                            "another path")  # fmt: skip
        seen[key] = role
