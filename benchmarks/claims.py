"""Claim files: several processes share one ranking shard, each taking the next run nobody holds."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def claim(path: Path) -> str | None:
    """Take the claim file `path` for this process (so several processes can share one shard, each taking the next
    run nobody holds): None when taken, else who holds it. A claim made on this machine whose process is gone — or
    made before the machine last started (another boot id: its pid may since name another process) — is taken over;
    one from another machine is respected (delete it by hand if that machine stopped)."""
    me = f"{socket.gethostname()} pid {os.getpid()} boot {boot_id()}"
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = path.read_text().strip() or "a process starting"
            host, _, rest = holder.partition(" pid ")
            pid, _, boot = rest.partition(" boot ")
            if host != socket.gethostname() or not pid.isdigit():
                return holder
            if boot == boot_id() and process_alive(int(pid)):
                return holder
            path.unlink(missing_ok=True)  # its process ended without finishing: take the run over
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me + "\n")
        return None
    return path.read_text().strip()


def boot_id() -> str:
    """This machine's boot id (Linux; "" elsewhere), so a claim outlives no restart."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        return ""


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
