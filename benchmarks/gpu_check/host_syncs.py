"""The `host_syncs` part: the host synchronisations of one Flow-GRPO step, counted, and where they are made.

The training step's hot path (diffusion_rl/algorithms/hot_path.py: the sampler's step functions and per-step loop, the
policy-gradient loss) makes none: a CPU test holds it to that (tests/sampling/test_no_host_sync.py). What is left
around it (seeds, checks, metrics read once per update, the images handed to the rewards) is counted here on
SD3.5-Medium LoRA at the replay part's small size: step 0 warms up, step 1 runs under
`torch.cuda.set_sync_debug_mode("warn")`, each warning's call stack giving its site and whether it was in the hot
path. On a CPU (the dry run) nothing waits: the same step runs under `HostReads` (diffusion_rl/utils/host_sync.py),
which notes the calls that would.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter

import torch

from diffusion_rl.algorithms.hot_path import hot_path
from diffusion_rl.utils.host_sync import HostRead, HostReads, call_site, inside, stack

from .parts import SMALL, Context, build, release, timed_steps

SITES = 10  # the first sites, and the most frequent, kept in the record


def host_syncs_part(ctx: Context) -> dict:
    """One Flow-GRPO step of SD3.5-Medium LoRA (2 images, 4 steps) with every host synchronisation noted."""
    _, _, trainer = build(ctx, "sd35_lora", SMALL, rows=2)
    timed_steps(trainer, 1)  # warm-up: autotuning, the FLOP count, caches
    watch = cuda_syncs if ctx.device_type == "cuda" else host_reads
    how, seen, hot = watch(functools.partial(timed_steps, trainer, 1, first=1))
    del trainer
    release()
    return {
        "model": "stable-diffusion-3.5-medium LoRA, 2 images, 4 steps", "how": how, "syncs": len(seen),
        "hot_path_syncs": len(hot), "first_sites": [str(s) for s in seen[:SITES]],
        "top_sites": [[site, n] for site, n in Counter(s.site for s in seen).most_common(SITES)],
        "hot_path_sites": [str(s) for s in hot[:SITES]],
    }  # fmt: skip


def cuda_syncs(step) -> tuple[str, list[HostRead], list[HostRead]]:
    """`step()` under CUDA's sync debug mode: each synchronisation's site, and those made in the hot path."""
    regions, seen, hot = hot_path(), [], []

    def note(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in stack(skip=1) if not f.f_code.co_filename.endswith("warnings.py")]  # the hook's callers
        seen.append(HostRead(str(message).splitlines()[0][:80], call_site(frames)))
        if inside(frames, regions):
            hot.append(seen[-1])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return 'torch.cuda.set_sync_debug_mode("warn")', seen, hot


def host_reads(step) -> tuple[str, list[HostRead], list[HostRead]]:
    """`step()` under `HostReads`: the calls that would synchronise on a GPU, and those in the hot path."""
    with HostReads(within=hot_path()) as hot, HostReads() as every:
        step()
    return "HostReads (CPU: the calls that would wait on a GPU)", every.seen, hot.seen
