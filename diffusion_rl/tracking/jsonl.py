"""Metrics as JSON lines: `<run_dir>/metrics.jsonl`, one object per `log_metrics` call, `"step"` first.

JSON has no NaN or infinity, so non-finite values are written as `null` (read back as None). Each row is
flushed and fsynced as it is written, so a crash loses nothing already logged; at worst the last line is cut
short, and both the reader and the next tracker on that file drop such a partial last line.
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

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def _parse_lines(path: Path, text: str) -> list[dict[str, Any]]:
    rows = []
    lines = text.split("\n")
    # text ends with "\n" when the last row is complete, which leaves one empty string at the end
    complete, tail = lines[:-1], lines[-1]
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}:{number} is not valid JSON ({error.msg}); fix or delete that line") from None
        if not isinstance(row, dict) or "step" not in row:
            raise UserError(f"{path}:{number} is not a metrics row (a JSON object with a 'step'); fix or delete it")
        rows.append(row)
    if tail.strip():
        logger.warning("%s: ignoring a partial last line (a run stopped while writing it)", path)
    return rows


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl file (or of `<path>/metrics.jsonl` when given a run directory), in order.

    Non-finite values come back as None. A cut-short last line (crash while writing) is skipped with a warning.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise UserError(f"no metrics file at {path}")
    return _parse_lines(path, path.read_text(encoding="utf-8"))


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
        rows = _parse_lines(self.path, self.path.read_text(encoding="utf-8"))
        kept = [row for row in rows if row["step"] <= step]
        if len(kept) < len(rows):
            where = f"after resumed step {step}" if step >= 0 else "of an earlier run (this one starts from scratch)"
            logger.info("%s: dropping %d rows %s", self.path, len(rows) - len(kept), where)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with naming(self.path), open(tmp, "w", encoding="utf-8") as out:
            out.writelines(json.dumps(row, allow_nan=False) + "\n" for row in kept)
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
