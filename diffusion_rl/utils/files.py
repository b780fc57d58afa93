"""Writes that name their file when they fail."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


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
