"""A checkpoint's manifest: the sha256 of every file in it, written when it is saved and checked before it is read.

    step_000010/manifest.sha256    one line per file: `<sha256>  <path inside the checkpoint>` (sha256sum's format:
                                   `cd step_000010 && sha256sum -c manifest.sha256` checks a copy by hand)

`write_manifest` runs when the checkpoint is complete — CheckpointManager.save calls it after the write function has
returned, so under the Ray engine after every worker has written its shards — in the temp directory, so the
manifest is fsynced and published by the same rename as the files it lists. `verify_checkpoint` runs before anything
of a checkpoint is read (resume, `sample`, `eval`, `export`, `checkpoint upgrade`, pretraining's resume): a file
changed, truncated, missing or added, a symbolic link or anything else that is not a plain file or folder is one
UserError naming the file. A checkpoint saved before manifests existed loads with one warning that it is unverified.

What it guards against: damage (a bad disk or copy, a crash of a tool editing a file) and mix-ups (a file of another
checkpoint or run). It is no signature: whoever can rewrite a file can rewrite the manifest too.

Cost: sha256 reads every byte once, at save and once per load (a load's later reads of the same checkpoint only
stat its files): about 1.5 GB/s per core on a CPU with SHA extensions, a few times slower without, and files are
hashed in parallel threads (MAX_THREADS), so a checkpoint of many files (one per Ray worker) is read at what the
disk gives.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from diffusion_rl.checkpoint.paths import refuse_link
from diffusion_rl.errors import UserError
from diffusion_rl.utils.digest import file_sha256

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.sha256"
MAX_THREADS = 8  # hashlib releases the GIL while it hashes, so threads hash files side by side
_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")

# checkpoint → its files' (path, size, mtime, ctime, inode) when it was last verified in this process: a load reads
# a checkpoint several times (its config, then its weights) and hashes it once; a file written since has a new ctime
_verified: dict[Path, tuple] = {}


def checkpoint_files(directory: Path) -> dict[str, os.stat_result]:
    """Every file of the checkpoint `directory` (paths relative to it, '/'-separated) with its stat; a UserError for
    a symbolic link (the directory itself or anything in it) or anything that is neither a file nor a folder."""
    refuse_link(directory)
    if not directory.is_dir():
        raise UserError(f"{directory} is not a checkpoint directory")
    found: dict[str, os.stat_result] = {}
    for folder, subfolders, files in os.walk(directory):
        for name in subfolders + files:
            path = Path(folder) / name
            refuse_link(path)
            info = path.lstat()
            if stat.S_ISREG(info.st_mode):
                found[path.relative_to(directory).as_posix()] = info
            elif not stat.S_ISDIR(info.st_mode):
                raise UserError(f"{path} is neither a file nor a folder: a checkpoint holds only its own files")
    return found


def _hash_all(directory: Path, names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=max(1, min(MAX_THREADS, len(names), os.cpu_count() or 1))) as pool:
        return dict(zip(names, pool.map(lambda name: file_sha256(directory / name), names)))


def write_manifest(directory: Path) -> Path:
    """Hash every file of the finished checkpoint `directory` into its manifest.sha256 (replacing an old one)."""
    names = sorted(n for n in checkpoint_files(directory) if n != MANIFEST_FILE)
    hashes = _hash_all(directory, names)
    path = directory / MANIFEST_FILE
    path.write_text("".join(f"{hashes[name]}  {name}\n" for name in names), encoding="utf-8")
    return path


def _read_manifest(path: Path) -> dict[str, str]:
    listed: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        match = _LINE.fullmatch(line)
        name = match and match[2]
        if not name or name.startswith("/") or ".." in name.split("/") or name == MANIFEST_FILE:
            raise UserError(f"{path}, line {number}: not '<sha256>  <file in the checkpoint>'; the manifest is damaged")
        listed[name] = match[1]
    return listed


def verify_checkpoint(directory: str | os.PathLike[str]) -> None:
    """Check the checkpoint `directory` against its manifest before it is read: a UserError naming the first file
    that is missing, added or changed (or a link, checkpoint_files); a warning for a checkpoint without one."""
    directory = Path(directory)
    files = checkpoint_files(directory)
    stamp = tuple(sorted((n, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino) for n, s in files.items()))
    key = directory.resolve()
    if _verified.get(key) == stamp:
        return
    if files.pop(MANIFEST_FILE, None) is None:
        logger.warning("%s has no %s (saved before checkpoints were verified): it is read unverified", directory,
                       MANIFEST_FILE)  # fmt: skip
    else:
        listed = _read_manifest(directory / MANIFEST_FILE)
        missing, added = sorted(set(listed) - set(files)), sorted(set(files) - set(listed))
        if missing:
            raise UserError(f"{directory / missing[0]}: missing, though the checkpoint's {MANIFEST_FILE} lists it")
        if added:
            raise UserError(f"{directory / added[0]}: not in the checkpoint's {MANIFEST_FILE}: added after the save")
        hashes = _hash_all(directory, sorted(listed))
        changed = [name for name in sorted(listed) if hashes[name] != listed[name]]
        if changed:
            raise UserError(
                f"{directory / changed[0]}: its sha256 differs from the checkpoint's {MANIFEST_FILE}: the file was "
                "damaged or changed after the checkpoint was saved"
            )
    _verified[key] = stamp
