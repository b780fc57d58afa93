"""What every settings dataclass is made of: fields with a one-line help text, and checks that name the key.

The run's config tree (the section modules beside this one) and the settings that live next to the code they
configure (a loss's settings next to the loss, pretraining's) both build on it; it imports nothing of ours but
errors.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

# the largest sizes and counts a config may ask for: far above any real run, low enough that a typo (an extra zero,
# a value in the wrong key) is refused at load instead of allocating until the machine gives up
MAX_PIXELS = 8192  # a side of an image
MAX_FRAMES = 1025  # frames of a video sample
MAX_STEPS = 1000  # denoising steps
MAX_GROUP = 1024  # samples of one prompt
MAX_BATCH = 4096  # prompts, rows or chunks of one step
MAX_COUNT = 100_000_000  # training steps and intervals counted in them
MAX_SECONDS = 10_000_000  # timeouts (~16 weeks)
MAX_BLOCKS = 1000  # transformer blocks of one model


@dataclass(frozen=True)
class Range:
    """The numbers a size, count or rate may take: lo ≤ x ≤ hi (lo < x with `lo_open`), always finite. The loader
    refuses any other value in one line naming the key and this range (config/convert.py); the reference shows it."""

    lo: float
    hi: float
    lo_open: bool = False

    def __contains__(self, value: Any) -> bool:
        if isinstance(value, dict):
            return all(v in self for v in value.values())
        if isinstance(value, (list, tuple)):
            return all(v in self for v in value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True  # not a number (null, a name): the type check's business
        if not math.isfinite(value):
            return False
        return (value > self.lo if self.lo_open else value >= self.lo) and value <= self.hi

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{_number(self.lo)}, {_number(self.hi)}]"


class OneOf:
    """The names a registry holds (`registry.names()`, looked up when a value is checked), after the fixed names
    `also` (e.g. "auto"): `opt(within=OneOf(R))` on a str field refuses any other name at load in one line listing
    them, and the reference lists them, so a plugin's name is spelled only where it registers (config/plugins.py's
    registries)."""

    def __init__(self, registry: Any, also: tuple[str, ...] = ()):
        self.registry = registry
        self.also = also

    @property
    def names(self) -> list[str]:
        return [*self.also, *self.registry.names()]

    def __contains__(self, value: Any) -> bool:
        return not isinstance(value, str) or value in self.names  # not a name: the type check's business

    def __str__(self) -> str:
        return "one of " + ", ".join(repr(n) for n in self.names)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e12 else f"{x:g}"


def opt(default: Any, help: str, *, factory: bool = False, within: Range | None = None):
    """A settings field with its help text (`factory` for mutable defaults) and, for a number, its allowed range."""
    metadata = {"help": help} if within is None else {"help": help, "within": within}
    if factory:
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def field_range(cls: type, name: str) -> Range:
    """The range settings dataclass `cls` declares for its field `name` (`opt(within=...)`)."""
    return {f.name: f for f in fields(cls)}[name].metadata["within"]


def check_flag(flag: str, value: float | None, key: str, cls: type) -> None:
    """A UserError naming command-line `flag` when `value` lies outside the range of config key `key` (a field of
    `cls`), the setting the flag stands for: the limits are declared once, on the config; None (unset) passes."""
    within = field_range(cls, key.rsplit(".", 1)[-1])
    if value is None or value in within:
        return
    from diffusion_rl.errors import UserError

    if not math.isfinite(value):
        bound = "finite"
    elif value > within.hi:
        bound = f"≤ {_number(within.hi)}"
    else:
        bound = f"> {_number(within.lo)}" if within.lo_open else f"≥ {_number(within.lo)}"
    raise UserError(f"{flag} must be {bound} (as {key}: {within}), got {value}")


def check(condition: bool, message: str) -> None:
    """A config value that cannot work: ValueError with `message` (the loader adds which key and file)."""
    if not condition:
        raise ValueError(message)
