"""The CUDA caching allocator's expandable segments: less device memory lost to fragmentation.

torch's caching allocator keeps the fixed-size segments it got from cudaMalloc and splits them among tensors; a step
whose tensors change size (rollout, VAE decode, update with checkpointing) leaves free pieces too small for the next
request, and the allocator asks the device for more. The GPU check measured it (benchmarks/RESULTS.md, runs 6–7):
SD3.5-medium's LoRA step reserved 22.6 GiB for 13.4 GiB of tensors, FLUX.2-klein's 26.3 for 16.3 — the difference
counts against the card as much as the tensors do. With `expandable_segments:True` the allocator maps more memory onto
the end of one segment instead (PyTorch's "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF").

- The user's own PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF always wins (forwarded as it is);
- else `engine.cuda_expandable_segments` (default true) sets `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.

The allocator reads the variable when CUDA starts in a process, so the CLI sets it before it imports torch (`apply`)
and the processes a Ray run starts get it in their environment (`child_env`). Harmless without a GPU. Stdlib only:
imported before torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

USER_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the second: torch ≥ 2.9's name for every device
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
SET_BY_US = "DIFFUSION_RL_ALLOC_SET"  # set by this module: a later decision does not take it as the user's


def user_setting(environ: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables the user set (not the one this module set)."""
    ours = environ.get(SET_BY_US) == "1"
    return {k: environ[k] for k in USER_VARS if k in environ and not (ours and k in EXPANDABLE)}


def child_env(expandable: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allocator variables of a process this run starts (or of this one, `apply`): the user's, else expandable
    segments when `expandable` (engine.cuda_expandable_segments), else none."""
    environ = os.environ if environ is None else environ
    return user_setting(environ) or (dict(EXPANDABLE) if expandable else {})


def apply(expandable: bool, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set this process's allocator variables (before torch starts CUDA) and return them; an earlier decision's (a
    parent CLI's) is replaced, the user's kept."""
    environ = os.environ if environ is None else environ
    if environ.pop(SET_BY_US, None) == "1":
        for key in EXPANDABLE:
            environ.pop(key, None)
    wanted = child_env(expandable, environ)
    if wanted and not user_setting(environ):
        environ.update(wanted)
        environ[SET_BY_US] = "1"
    return wanted
