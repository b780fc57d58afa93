"""Whether a model path names a Hugging Face Hub repository (a string rule: config/ checks it at load, models/hub.py
resolves the repository)."""

from __future__ import annotations

import os


def names_hub_repo(path: str | os.PathLike) -> bool:
    """Whether `path` could name a Hub repository: exactly `owner/name` in the Hub's characters (no `./`, `/` or `~`
    in front). A folder that must never be taken for one is written `./owner/name` (or absolute)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    text = str(path)
    if text.count("/") != 1 or text.startswith((".", "~")) or not all(text.split("/")):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True
