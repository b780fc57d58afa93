"""Metrics as JSON lines: `<run_dir>/metrics.jsonl`, one object per `log_metrics` call, `"step"` first.

JSON has no NaN or infinity, so non-finite values are written as `null` (read back as None). Each row is
flushed and fsynced as it is written, so a crash loses nothing already logged; at worst the last line is cut
short, and both the reader and the next tracker on that file drop such a partial last line. A line that is not a
row (damaged, edited by hand) is skipped with a warning by the reader, and kept as it is by a resume.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from diffusion_rl.errors import UserError
from diffusion_rl.tracking.base import is_finite, to_scalar
from diffusion_rl.utils.files import naming
from diffusion_rl.utils.json_input import parse_json

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def _read_lines(path: Path) -> list[tuple[bytes, dict[str, Any] | None]]:
    """(line, its row) for each complete non-blank line of metrics file `path`, the row None where the line is not
    a metrics row (damaged, or edited by hand); a value that is not a number is left out of its row (a later step's
    would pass for the key's first). One warning names the first line of each kind; a cut-short last line is left out
    with a warning."""
    lines = path.read_bytes().split(b"\n")
    # the file ends with "\n" when the last row is complete, which leaves one empty piece at the end
    complete, tail = lines[:-1], lines[-1]
    out: list[tuple[bytes, dict[str, Any] | None]] = []
    bad_rows: list[str] = []  # "N: what is wrong" per line that is not a row
    bad_values: list[str] = []  # "N: 'KEY' is VALUE" per value that is not a number
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        row = _row(line)
        if isinstance(row, str):
            bad_rows.append(f"{number}: {row}")
            out.append((line, None))
            continue
        for key in [k for k, v in row.items() if k != "step" and v is not None and not _is_number(v)]:
            value = row.pop(key)  # a list or object is named by its type: it may be nested too deep to print
            shown = json.dumps(value)[:40] if isinstance(value, str | bool) else f"a JSON {type(value).__name__}"
            bad_values.append(f"{number}: {key!r} is {shown}, not a number")
        out.append((line, row))
    if bad_rows:
        logger.warning("%s:%s; skipping %s: fix the line or delete it", path, bad_rows[0], _and_more(bad_rows, "line"))
    if bad_values:
        logger.warning("%s:%s; skipping %s", path, bad_values[0], _and_more(bad_values, "value"))
    if tail.strip():
        logger.warning("%s: ignoring a partial last line (a run stopped while writing it)", path)
    return out


def _row(line: bytes) -> dict[str, Any] | str:
    """The metrics row `line` holds, or what is wrong with it."""
    try:
        row = parse_json(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        return f"not UTF-8 text ({error.reason} at byte {error.start})"
    except json.JSONDecodeError as error:
        return f"not valid JSON ({error.msg})"
    if not isinstance(row, dict) or not (isinstance(row.get("step"), int) and not isinstance(row["step"], bool)):
        return "not a metrics row (a JSON object with an integer 'step')"
    return row


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _and_more(found: list[str], what: str) -> str:
    more = len(found) - 1
    return f"it and {more} more such {what}{'s' * (more > 1)}" if more else "it"


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl file (or of `<path>/metrics.jsonl` when given a run directory), in order.

    Non-finite values come back as None. A cut-short last line (crash while writing), a line that is not a row and a
    value that is not a number are skipped with a warning naming the line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise UserError(f"no metrics file at {path}")
    return [row for _, row in _read_lines(path) if row is not None]


class JsonlTracker:
    """Appends metrics rows to `<run_dir>/metrics.jsonl`. Images are not stored here (see TensorBoard / W&B)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_partial_last_line()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the whole run

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if "step" in metrics:
            raise ValueError("'step' is reserved in metrics rows; pass the step as the `step` argument")
        row: dict[str, Any] = {"step": int(step)}
        for name, value in metrics.items():
            scalar = to_scalar(name, value)
            row[name] = scalar if is_finite(scalar) else None
        with naming(self.path):
            self._file.write(json.dumps(row, allow_nan=False) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())

    def log_images(self, tag: str, image: np.ndarray, step: int, caption: str = "") -> None:
        pass

    def log_video(self, tag: str, video: np.ndarray, step: int, caption: str = "", fps: float = 8) -> None:
        pass

    def resume_from(self, step: int) -> None:
        """Drops the rows a crashed run logged after `step` (the resumed checkpoint; -1: a start from scratch, which
        logs step 0 again), so no step appears twice."""
        self._file.close()
        lines = _read_lines(self.path)
        kept = [line for line, row in lines if row is None or row["step"] <= step]  # a damaged line stays, as it was
        if len(kept) < len(lines):
            where = f"after resumed step {step}" if step >= 0 else "of an earlier run (this one starts from scratch)"
            logger.info("%s: dropping %d rows %s", self.path, len(lines) - len(kept), where)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with naming(self.path), open(tmp, "wb") as out:
            out.writelines(line + b"\n" for line in kept)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def close(self) -> None:
        self._file.close()

    def _drop_partial_last_line(self) -> None:
        # An append after a cut-short line would glue the new row onto it and corrupt both.
        if not self.path.is_file():
            return
        with open(self.path, "rb+") as file:
            data = file.read()
            if not data or data.endswith(b"\n"):
                return
            keep = data.rfind(b"\n") + 1
            logger.warning("%s: removing a partial last line (a run stopped while writing it)", self.path)
            file.truncate(keep)
