"""The `fsdp2_compiled` part: the `fsdp2` part's step (the Ray engine's FSDP2 worker at world size 1, without Ray)
eager and with compiled blocks, each in its own process.

`model.compile_blocks` is on by default on CUDA (run 10's `defaults_ab`: SD3.5-Medium LoRA's step × 0.49–0.54 on the
local engine), but compiled blocks under FSDP2, where each block's parameters are sharded (DTensors) and gathered by
FSDP2's hooks around the block, have never run: the `fsdp2` part builds with `PINNED` (parts.py), so its sharded
worker runs eager. This part runs that step (SD3.5-Medium LoRA, 2 images, 4 steps) with `model.compile_blocks=false`
(`eager`: the `fsdp2` part's own figures) and `true` (`compiled`: compiling from an empty cache folder, as
`defaults_ab`'s `compiled`): warm-up step (compile seconds counted), step, rollout and update seconds,
`logp_diff_max` (eager 0; compiled 2.4e-4 on the local engine in run 10), peak memory, and compiled over eager.
A compile that fails under FSDP2 is recorded as its variant's error, which is the finding. The dry run forces compiled
code eager (`torch.compiler.set_stance`), so it shows the plumbing, not the compiler.
"""

from __future__ import annotations

import functools
import os

import torch

from diffusion_rl.models.compiling import CACHE_VARIABLE

from .cudnn_ab import run_variant
from .parts import Context, fsdp2_part

VARIANTS = {"eager": "false", "compiled": "true"}  # model.compile_blocks, in the order they run
CAPS_S = {"eager": 40.0, "compiled": 130.0}  # eager: 9 s in run 6; compiled: SD3.5's blocks compiled in 67 s (run 10)
RATIOS = ("step_s", "rollout_s", "update_s", "peak_reserved_gib")


def variant(ctx: Context, label: str) -> dict:
    """In the variant's process: the fsdp2 part's step with model.compile_blocks of `label`."""
    os.environ[CACHE_VARIABLE] = str(ctx.work / "inductor_fsdp2")  # empty: a cold compile
    if ctx.dry_run:  # an inductor compile takes minutes on a CPU
        torch.compiler.set_stance("force_eager")
    return fsdp2_part(ctx, (f"model.compile_blocks={VARIANTS[label]}",))


def fsdp2_compiled_part(ctx: Context) -> dict:
    """The FSDP2 worker's step at world size 1 eager, then with compiled blocks; each in its own process."""
    result = {"variants": {k: f"model.compile_blocks={v}" for k, v in VARIANTS.items()},
              "compiler": "forced eager (dry run)" if ctx.dry_run else "inductor", "runs": {}}  # fmt: skip
    runs = result["runs"]
    for label in VARIANTS:
        runs[label] = run_variant(ctx, f"fsdp2_compiled_{label}", functools.partial(variant, ctx, label), CAPS_S[label])
        eager, compiled = ((runs.get(v) or {}).get("result") or {} for v in VARIANTS)
        if eager and compiled:
            both = [k for k in RATIOS if compiled.get(k) and eager.get(k)]
            result["ratios"] = {f"{k}_ratio": compiled[k] / eager[k] for k in both}
        ctx.keep(result)
    return result
