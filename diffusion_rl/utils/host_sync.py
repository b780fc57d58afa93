"""Host reads: the torch calls that, on a GPU, make the host wait for the device — seen on any device, the CPU included.

`HostReads` is a TorchFunctionMode. While it is active, a call that on a GPU would wait for the kernels queued before
it is noted with its call site (the innermost frame outside torch): a tensor read back to the host (`.item()`,
`.tolist()`, `.cpu()`, `.numpy()`, `.to("cpu")`, Python's `bool()`, `int()`, `float()` or a tensor used as an index),
`nonzero` and what needs its count (boolean-mask indexing, `masked_select`, `unique`, `argwhere`, one-argument
`where`, `repeat_interleave` without `output_size`), comparisons answered on the host (`equal`, `allclose`,
`is_nonzero`), and a tensor made from host data (`torch.tensor`/`as_tensor` of Python numbers: on a GPU a copy that
waits). With `within`, only the calls made inside those regions (a function, or the lines of its first loop, on the
call stack) count; `raising` raises at the first one with its site, else `seen` lists them.

The training step's hot path — each sampler step of a rollout and the policy-gradient loss of each trained step —
makes none (docs/architecture.md; tests/sampling/test_no_host_sync.py); the GPU check counts the real ones of a whole
step (benchmarks/gpu_check/host_syncs.py).
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
         "masked_select", "unique", "unique_consecutive", "equal", "allclose", "is_nonzero"}  # fmt: skip
FROM_HOST = {"tensor", "as_tensor", "asarray", "new_tensor"}
_SKIPPED = (str(Path(torch.__file__).parent), __file__)  # a call site is the first frame outside these


@dataclass(frozen=True)
class Region:
    """Lines first..last of one function's code: a stack frame running them is inside the region."""

    code: object
    first: int
    last: int

    @classmethod
    def of(cls, fn, loop: bool = False) -> Region:
        """The whole of `fn` (unwrapped from its decorators), or with `loop` the lines of its first `for` loop."""
        fn = inspect.unwrap(fn)
        code = fn.__code__
        if not loop:
            return cls(code, code.co_firstlineno, max(line for _, _, line in code.co_lines() if line is not None))
        lines, start = inspect.getsourcelines(fn)
        node = next(n for n in ast.walk(ast.parse(textwrap.dedent("".join(lines)))) if isinstance(n, ast.For))
        return cls(code, start + node.lineno - 1, start + node.end_lineno - 1)

    def holds(self, frame) -> bool:
        return frame.f_code is self.code and self.first <= frame.f_lineno <= self.last


@dataclass(frozen=True)
class HostRead:
    call: str  # the torch call, e.g. "item", "__getitem__ with a boolean mask"
    site: str  # file:line (function) of the innermost frame outside torch

    def __str__(self) -> str:
        return f"{self.call} at {self.site}"


class HostSyncError(AssertionError):
    """A host read inside a region that must make none."""


def host_read(func, args, kwargs) -> str | None:
    """The name of the host read `func(*args, **kwargs)` is, or None."""
    name = getattr(func, "__name__", "")
    if name in READS:
        return name
    if name in FROM_HOST:
        data = args[1] if name == "new_tensor" else (args[0] if args else kwargs.get("data"))
        return None if isinstance(data, torch.Tensor) else f"{name} of host data"
    if name == "where" and len(args) + len(kwargs) == 1:
        return "where (one argument)"
    if name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor):
        return None if kwargs.get("output_size") is not None else "repeat_interleave without output_size"
    if name in ("__getitem__", "__setitem__") and _has_mask(args[1] if len(args) > 1 else None):
        return f"{name} with a boolean mask"
    if name == "to" and _to_host(args[0], args[1:], kwargs):
        return "to the host"
    return None


def _has_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _to_host(tensor, args, kwargs) -> bool:
    targets = [*args, kwargs.get("device")]
    to_cpu = any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)
    return to_cpu and isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu"


def stack(skip: int = 1) -> list:
    """The caller's frames outward, the innermost first (`skip`: frames of the caller's own to leave out)."""
    frames, frame = [], sys._getframe(skip + 1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def call_site(frames: list) -> str:
    """file:line (function) of the innermost frame outside torch and this module."""
    site = next((f for f in frames if not f.f_code.co_filename.startswith(_SKIPPED)), frames[0])
    return f"{site.f_code.co_filename}:{site.f_lineno} ({site.f_code.co_name})"


def inside(frames: list, regions: tuple[Region, ...]) -> bool:
    return any(r.holds(f) for f in frames for r in regions)


class HostReads(TorchFunctionMode):
    """Notes (or, `raising`, raises `HostSyncError` at) each host read made while active, inside `within` if given."""

    def __init__(self, within: tuple[Region, ...] | None = None, raising: bool = False):
        super().__init__()
        self.within, self.raising = within, raising
        self.seen: list[HostRead] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = host_read(func, args, kwargs)
        if read is not None:
            self._note(read, stack(skip=1))
        return func(*args, **kwargs)

    def _note(self, read: str, frames: list) -> None:
        if self.within is not None and not inside(frames, self.within):
            return
        seen = HostRead(read, call_site(frames))
        if self.raising:
            raise HostSyncError(f"host synchronisation in the hot path: {seen}")
        self.seen.append(seen)
