"""What every settings dataclass is made of: fields with a one-line help text, and checks that name the key.

A leaf module: the config tree (config.py) and the settings that live next to the code they configure (a loss's
settings next to the loss) both build on it, so neither has to import the other.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, *, factory: bool = False):
    """A settings field with its help text (`factory` for mutable defaults)."""
    if factory:
        return field(default_factory=default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def check(condition: bool, message: str) -> None:
    """A config value that cannot work: ValueError with `message` (the loader adds which key and file)."""
    if not condition:
        raise ValueError(message)
