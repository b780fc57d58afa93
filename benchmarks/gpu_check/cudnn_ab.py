"""The `cudnn_ab` part: one warm Flow-GRPO step of each model with torch's cuDNN attention kernel off and on.

It settles whether `model.attention_backend: sdpa` turning torch's cuDNN SDPA kernel off on CUDA (models/attention.py,
since GPU-check run 5, because that kernel's backward crashed FLUX.1-dev's LoRA step) is what made run 7's updates
slower than run 2's (Wan 2.1 +36 %, SD3.5 and Qwen-Image +8–11 %; benchmarks/RESULTS.md, "Run 7").

Both variants are `model.attention_backend=sdpa`; once the model is built, each sets torch's process-wide switch
(`torch.backends.cuda.enable_cudnn_sdp`) itself: `cudnn_off`, as `sdpa` does on CUDA now, or `cudnn_on`, torch's
default and runs 2–4's code (recent torch tries cuDNN before flash attention on sm90 with a recent cuDNN). That is the
one difference between run 2 and run 7; it reaches SD3.5 too, whose joint attention refuses `_native_cudnn`; and it is
what the default becomes if cuDNN is let back in. `_native_cudnn` (cuDNN forced on every call, after a copy of q, k
and v; what a user of the other families can switch to today) is measured on Wan by the `attention` part. Which
kernel torch picks is counted per call in the warm-up step (`torch._fused_sdp_choice` on the call's arguments), so a
variant that did not run the kernel it names shows in the record.

Each variant runs in its own process, forked from the part's (which never touches CUDA): an illegal memory access
poisons a CUDA context, so a variant's crash — an exception, or its process dying — is recorded and the next variant
runs. The part's process is the check's daemonic multiprocessing child, which multiprocessing forbids children, so
the variants are forked with `os.fork`; each gets a cap inside the part's, and dies with the part if that is killed.
Variants alternate per model (off, then on); the models run cheapest and most telling first, FLUX.1's cuDNN variant
(the one expected to crash) last, so a cut at the cap loses the least. On a CPU (the dry run) the switch is a no-op:
both variants pick the same kernel, and the record says so.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .parts import RUNS, Context, build, memory_gib, reset_peaks, run_config, step_health, timed_steps


@dataclass(frozen=True)
class ABRun:
    rows: int  # images (videos) per step: one micro-batch, one optimizer step
    overrides: tuple[str, ...] = ()  # on top of the model part's run (RUNS)
    note: str = ""  # the size, for the record


# Small steps whose update should still take 1.5–4 s on an H200 (runs 6 and 7's update seconds per image and trained
# step), in the order they run: Wan (run 7's +36 %) and SD3.5 first, the two cheap distilled models, then
# Qwen-Image (slow to build), FLUX.1-dev last (its cuDNN backward crashed in run 5).
AB_RUNS = {
    "wan21_lora": ABRun(2, ("sampling.num_steps=4",), "2 videos of 17 frames, 4 steps (3 trained)"),
    "sd35_lora": ABRun(2, (), "2 images, 10 steps (9 trained)"),
    "z_image_lora": ABRun(4, (), "4 images, 8 steps (a window of 2)"),
    "flux2_klein_lora": ABRun(6, (), "6 images, 4 steps (a window of 2)"),
    "qwen_image_lora": ABRun(2, ("sampling.num_steps=5", "sampling.window.hi=4"), "2 images, 5 steps (a window of 2)"),
    "flux_lora": ABRun(2, (), "2 images, 6 steps (5 trained)"),
}
COMMON = ("log.flops=false", "train.num_minibatches=1")
DRY_MODELS = ("wan21_lora", "sd35_lora")  # the dry run's: a dispatcher family and SD3's own attention call
VARIANTS = {"cudnn_off": False, "cudnn_on": True}
VARIANT_CAP_S = 45.0  # one variant's process at most (the slowest, Qwen-Image's, is ~15 s on an H200)
MIN_VARIANT_S = 8.0  # a variant is not started with less of the part's cap left
MARGIN_S = 3.0  # a variant is killed this long before the part's own cap, so the part records it


def sizes(name: str, dry_run: bool) -> tuple[list[str], int]:
    """(overrides, rows) of model `name` in the A/B; the dry run keeps the tiny sizes of the check's other parts."""
    if dry_run:
        return [*COMMON, "train.micro_batch_size=2"], 2
    run = AB_RUNS[name]
    return [*COMMON, f"train.micro_batch_size={run.rows}", *run.overrides], run.rows


@contextlib.contextmanager
def sdpa_kernels() -> Iterator[Counter]:
    """Within the block, count the kernel torch's scaled_dot_product_attention picks for each call (by name:
    FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION, MATH). diffusers' processors look the function up on
    torch.nn.functional at each call, so replacing it there sees them all."""
    from torch.nn import functional
    from torch.nn.attention import SDPBackend

    original, counts = functional.scaled_dot_product_attention, Counter()

    def counting(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                         enable_gqa=enable_gqa)  # fmt: skip
        counts[SDPBackend(choice).name] += 1
        return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    functional.scaled_dot_product_attention = counting
    try:
        yield counts
    finally:
        functional.scaled_dot_product_attention = original


def variant(ctx: Context, name: str, cudnn: bool) -> dict:
    """In the variant's process: model `name` at its A/B size, torch's cuDNN attention switch set, a warm-up step
    (its kernels counted), then one measured step."""
    extra, rows = sizes(name, ctx.dry_run)
    started = time.perf_counter()
    _, _, trainer = build(ctx, name, extra, rows=rows)
    built_s = time.perf_counter() - started
    torch.backends.cuda.enable_cudnn_sdp(cudnn)  # after the build: loading with `sdpa` turned it off on CUDA
    with sdpa_kernels() as kernels:
        warm = timed_steps(trainer, 1)[0]
    reset_peaks()
    measured = timed_steps(trainer, 1, first=1)[0]
    return {"images": rows, "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(), "kernels": dict(kernels),
            "build_s": built_s, "warmup_step_s": warm["wall_s"], "warmup_update_s": warm.get("timing/update"),
            "step_s": measured["wall_s"], "rollout_s": measured.get("timing/generate"),
            "update_s": measured.get("timing/update"), "logp_diff_max": measured.get("train/logp_diff_max"),
            **step_health(measured), **memory_gib()}  # fmt: skip


def isolated(function: Callable[[], dict], result_file: Path, cap_s: float, threads: int = 1) -> dict:
    """`function()` in a forked process for at most `cap_s` seconds: {"status": "ok", "result"}, or "failed" with the
    error (an exception, or the process died: a signal, an abort inside a CUDA library), or "timeout"; with the
    seconds it took; it computes on `threads` CPU threads. The process is killed with its parent's."""
    sys.stdout.flush()  # else the child's exit could print what this process had buffered a second time
    parent, started = os.getpid(), time.perf_counter()
    pid = os.fork()
    if pid == 0:
        die_with(parent)
        torch.set_num_threads(threads)
        try:
            record = {"status": "ok", "result": function()}
        except BaseException as e:  # noqa: BLE001 — a crash of the variant is the finding
            record = {"status": "failed", "error": f"{type(e).__name__}: {str(e)[:600]}",
                      "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
        try:
            result_file.write_text(json.dumps(record, default=str))
        finally:
            sys.stdout.flush()
            os._exit(0)  # no atexit work, no CUDA teardown (a poisoned context may hang in it)
    deadline = time.monotonic() + cap_s
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"status": "timeout", "error": f"killed after its cap of {cap_s:.0f} s",
                    "seconds": time.perf_counter() - started}  # fmt: skip
        time.sleep(0.05)
    if result_file.is_file():
        record = json.loads(result_file.read_text())
    else:
        record = {"status": "failed", "error": f"the process died (exit code {os.waitstatus_to_exitcode(done[1])})"}
    return {**record, "seconds": time.perf_counter() - started}


def run_variant(ctx: Context, label: str, function: Callable[[], dict], cap_s: float) -> dict:
    """One variant of an A/B part (`label` names its result file) in its own process (`isolated`), capped at `cap_s`
    and inside the part's own cap; "not_run" when too little of that is left."""
    cap = min(cap_s, ctx.seconds_left() - MARGIN_S)
    if cap < MIN_VARIANT_S:
        return {"status": "not_run", "error": "the part's cap was near"}
    torch.set_num_threads(1)  # this process only forks the variants: OpenMP's threads would not survive (gpu_check.py)
    return isolated(function, ctx.work / f"{label}.json", cap, ctx.threads)


def die_with(parent: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux's PR_SET_PDEATHSIG): a variant left running by a
    killed part would hold the GPU's memory through the next parts."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before that took effect
        os._exit(1)


def cudnn_ab_part(ctx: Context) -> dict:
    """Each model's warm step with torch's cuDNN attention kernel off (what `sdpa` does on CUDA) and on, each variant
    in its own process: rollout and update seconds, the kernels picked, and whether the cuDNN variant crashed."""
    names = list(DRY_MODELS if ctx.dry_run else AB_RUNS)
    if ctx.dry_run:  # the real sizes' configs load (their overrides are checked before a GPU session)
        for name in AB_RUNS:
            run_config(replace(ctx, dry_run=False), RUNS[name], *sizes(name, False))
    result = {"variants": {"cudnn_off": "sdpa, torch.backends.cuda.enable_cudnn_sdp(False) (the default since run 5)",
                           "cudnn_on": "sdpa, torch.backends.cuda.enable_cudnn_sdp(True) (torch's default; runs 2-4)"},
              "switch": "no-op on the CPU: both variants run the same kernel" if ctx.dry_run else "cuda",
              "runs": {}}  # fmt: skip
    for name in names:
        runs = result["runs"][name] = {"size": "tiny preset, 2 images" if ctx.dry_run else AB_RUNS[name].note}
        for label, cudnn in VARIANTS.items():
            runs[label] = run_variant(ctx, f"cudnn_ab_{name}_{label}", functools.partial(variant, ctx, name, cudnn),
                                      VARIANT_CAP_S)  # fmt: skip
            off, on = (runs.get(v, {}).get("result") or {} for v in VARIANTS)
            if off.get("update_s") and on.get("update_s"):
                runs["update_ratio"] = on["update_s"] / off["update_s"]
                runs["step_ratio"] = on["step_s"] / off["step_s"]
            ctx.keep(result)
    return result
