"""The text a prompt asks an image to show: its `ground_truth`, else the first double-quoted string of the prompt.

Data preparation (`prepare ocr`) and the text rewards (`ocr`, the `vlm` judge's transcription mode) both read it;
it lives with the data so that rewards import data, never the other way round.
"""

import re
from collections.abc import Mapping
from typing import Any

# Quote pairs, left to right: "..." (straight quotes) or “...” (typographic quotes).
_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')


def quoted_text(prompt: str) -> str | None:
    """The first double-quoted string with a visible character in `prompt` ('A sign that says "OPEN"' → 'OPEN'),
    or None when there is none."""
    for match in _QUOTED.finditer(prompt):
        text = match.group(1) if match.group(1) is not None else match.group(2)
        if text.strip():
            return text
    return None


def target_text(prompt: str, metadata: Mapping[str, Any]) -> str | None:
    """The text an image should show: metadata["ground_truth"] when it is a non-blank string, else the prompt's
    first quoted string; None when neither gives one."""
    ground_truth = metadata.get("ground_truth")
    if isinstance(ground_truth, str) and ground_truth.strip():
        return ground_truth
    quoted = quoted_text(prompt)
    if quoted is not None and quoted.strip():
        return quoted
    return None
