"""The `defaults_ab` part: the CUDA defaults of issue 45 each against what runs 2–9 ran, one process per variant.

`model.compile_blocks: auto` and `train.fused_adamw: auto` (diffusion_rl/models/compiling.py) turn compiled blocks and
torch's fused AdamW on where the model is on CUDA. The check's model parts keep both off (parts.py, `PINNED`), so
their figures stay comparable with runs 2–9; this part measures what each default changes, on SD3.5-Medium LoRA
(compiled blocks: run 6 measured × 0.58 on a smaller step) and full fine-tuning (2.2 B trained parameters: where a
fused optimizer step matters most), at cudnn_ab's small SD3.5 size (2 images, 10 steps):

- `baseline`: both off (runs 2–9);
- `fused`: fused AdamW on;
- `compiled`: compiled blocks on, compiling from an empty cache folder (its warm-up step holds the compile time);
- `compiled_cached`: the same in a fresh process on the folder `compiled` filled: what torch's caches
  (`TORCHINDUCTOR_CACHE_DIR`, which a run points at the user's cache folder) save a second run.

Each variant: build, a warm-up step (dynamo's compile seconds counted), one measured step; rollout, update and step
seconds, `logp_diff_max` (the rollout replayed by the update: 0 eager; 2.4e-4 compiled in run 10), the trained weights'
L2 norm after both steps (fused against foreach AdamW: equal up to float rounding), skipped updates, peak memory.
The ratios against `baseline` decide each default: kept where it wins (run 10 kept both: benchmarks/RESULTS.md).
The dry run forces compiled code eager (`torch.compiler.set_stance`: an inductor compile takes minutes on a CPU), so
it shows the plumbing, not the compiler.
"""

from __future__ import annotations

import functools
import os

import torch

from diffusion_rl.models.compiling import CACHE_VARIABLE, compile_seconds

from .cudnn_ab import run_variant, sizes
from .parts import Context, build, memory_gib, reset_peaks, step_health, timed_steps

# variant → (model.compile_blocks, train.fused_adamw), in the order they run (compiled_cached after compiled)
VARIANTS = {
    "baseline": ("false", "false"),
    "fused": ("false", "true"),
    "compiled": ("true", "false"),
    "compiled_cached": ("true", "false"),
}
MODELS = {"sd35_lora": tuple(VARIANTS), "sd35_full": ("baseline", "fused")}  # full: the optimizer's share is largest
VARIANT_CAP_S = 120.0  # a compiling variant: run 6 compiled SD3.5's blocks in 67 s


def variant(ctx: Context, name: str, label: str) -> dict:
    """In the variant's process: model `name` with the variant's settings, a warm-up step, then one measured step."""
    blocks, fused = VARIANTS[label]
    os.environ[CACHE_VARIABLE] = str(ctx.work / f"inductor_{name}")  # empty for `compiled`, filled for the next
    if ctx.dry_run:
        torch.compiler.set_stance("force_eager")
    extra, rows = sizes("sd35_lora", ctx.dry_run)
    _, _, trainer = build(ctx, name, [*extra, f"model.compile_blocks={blocks}", f"train.fused_adamw={fused}"], rows)
    engine = trainer.engine
    warm = timed_steps(trainer, 1)[0]
    compiled_s = compile_seconds()
    reset_peaks()
    measured = timed_steps(trainer, 1, first=1)[0]
    weights = engine.model.trainable_parameters()
    return {"images": rows, "compile_blocks": engine.model.policies.compile_blocks,
            "fused_adamw": bool(engine.optimizer.optimizer.defaults.get("fused")),
            "warmup_step_s": warm["wall_s"], "compile_s": compiled_s, "step_s": measured["wall_s"],
            "rollout_s": measured.get("timing/generate"), "update_s": measured.get("timing/update"),
            "logp_diff_max": measured.get("train/logp_diff_max"),
            "weights_l2": float(torch.sqrt(sum((w.detach().double() ** 2).sum() for w in weights))),
            **step_health(measured), **memory_gib()}  # fmt: skip


def ratios(runs: dict) -> dict:
    """Each variant's step, rollout and update seconds over `baseline`'s, and its weights' relative difference."""
    base = (runs.get("baseline") or {}).get("result") or {}
    out = {}
    for label, run in runs.items():
        result = (run or {}).get("result") or {}
        if label == "baseline" or not base or not result:
            continue
        out[label] = {f"{k}_ratio": result[k] / base[k] for k in ("step_s", "rollout_s", "update_s")
                      if result.get(k) and base.get(k)}  # fmt: skip
        out[label]["weights_rel_diff"] = abs(result["weights_l2"] - base["weights_l2"]) / base["weights_l2"]
    return out


def defaults_ab_part(ctx: Context) -> dict:
    """SD3.5-Medium LoRA with compiled blocks (cold and cached) and fused AdamW against both off; full fine-tuning
    with fused AdamW against off; each variant in its own process."""
    result = {"variants": {k: f"model.compile_blocks={b}, train.fused_adamw={f}" for k, (b, f) in VARIANTS.items()},
              "compiler": "forced eager (dry run)" if ctx.dry_run else "inductor", "runs": {}}  # fmt: skip
    for name, labels in MODELS.items():
        runs = result["runs"][name] = {}
        for label in labels:
            runs[label] = run_variant(ctx, f"defaults_ab_{name}_{label}", functools.partial(variant, ctx, name, label),
                                      VARIANT_CAP_S)  # fmt: skip
            result["ratios"] = {n: ratios(r) for n, r in result["runs"].items()}
            ctx.keep(result)
    return result
