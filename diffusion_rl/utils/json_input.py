"""JSON from a user's file, where malformed text of any kind is a `json.JSONDecodeError`: `json.loads` also raises
RecursionError (arrays or objects nested past Python's recursion limit) and ValueError (an integer longer than
`sys.get_int_max_str_digits()`), which a reader that names the file and line on a JSONDecodeError would let through
as a traceback. `json_lines` reads a JSON-lines file a run wrote, past lines damaged or edited by hand."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEPTH = 100  # nesting said to be too deep: json fails far deeper (near the recursion limit, ~1000)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[{\]}]')  # a string (its brackets do not count) or a bracket


def parse_json(text: str) -> Any:
    """`json.loads(text)`; a JSONDecodeError for any malformed text, at the bracket past `DEPTH` levels or the
    first digit of the too long integer."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError(f"arrays or objects nested over {DEPTH} deep", text, _too_deep(text)) from None
    except json.JSONDecodeError:
        raise
    except ValueError:  # json's one other: an integer too long to convert
        limit = sys.get_int_max_str_digits()
        digits = re.search(rf"\d{{{limit + 1},}}", text)
        where = digits.start() if digits else 0
        raise json.JSONDecodeError(f"an integer of over {limit:,} digits", text, where) from None


def _too_deep(text: str) -> int:
    depth = 0
    for token in _TOKEN.finditer(text):
        depth += 1 if token[0] in "[{" else -1 if token[0] in "]}" else 0
        if depth > DEPTH:
            return token.start()
    return 0


def json_lines(path: Path, keys: tuple[str, ...]) -> list[tuple[str, dict | None]]:
    """(line, its object) for each non-blank line of the JSON-lines file `path`, the object None where the line is
    not a JSON object holding `keys` (damaged, or edited by hand); one warning names the first such line. A reader
    skips those lines, a writer that rewrites the file keeps them as they are."""
    out: list[tuple[str, dict | None]] = []
    bad: list[int] = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        line = raw.decode("utf-8", errors="replace")
        if not line.strip():
            continue
        try:
            row = parse_json(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or any(key not in row for key in keys):
            row = None
            bad.append(number)
        out.append((line, row))
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        logger.warning("%s:%d%s: not a JSON object with %s; skipped", path, bad[0], more, ", ".join(keys))
    return out
