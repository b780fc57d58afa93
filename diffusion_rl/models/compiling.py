"""The CUDA defaults of a run's kernels: compiled blocks (`model.compile_blocks`) and fused AdamW
(`train.fused_adamw`), each `auto` = on where the trained network is on a CUDA device and off elsewhere, so a CPU
run computes exactly what it did before; torch's compile caches kept where later runs find them; and the compile
time said once. The GPU check's `defaults_ab` kept both (run 10, an H200, SD3.5-Medium: compiled blocks' step × 0.54
cold, × 0.49 on the cache; fused AdamW's × 0.98 LoRA, × 0.91 full). Compiled blocks are not bit-exact in replay: the
rollout runs their no-grad graphs and the update their grad graphs, which inductor compiles differently
(`train/logp_diff_max` 2.4e-4 where eager gives 0; docs/gpu.md).

torch's inductor keeps what it compiled (its FX graph cache and AOTAutograd's cache, both on by default) under
`TORCHINDUCTOR_CACHE_DIR`, by default a folder in /tmp that a fresh machine or a reboot loses. A run that compiles
points it at the user's cache folder (`$XDG_CACHE_HOME/diffusion-rl/torchinductor`, else
`~/.cache/diffusion-rl/torchinductor`) unless the variable is set, so a second run of the same shapes loads its
kernels instead of compiling them (dynamo still traces; the compile time shown says what is left).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def on_cuda(setting: bool | str, device: torch.device) -> bool:
    """A `bool | "auto"` option resolved for a network on `device`: auto is on for CUDA, off elsewhere."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def compile_blocks_on(cfg, device: torch.device) -> bool:
    """Whether `cfg`'s (a ModelConfig) network on `device` runs compiled blocks: `auto` is on for CUDA unless
    model.compile already compiles its sampling passes."""
    setting = getattr(cfg, "compile_blocks", False)
    return on_cuda(setting, device) and not (setting == "auto" and getattr(cfg, "compile", False))


def use_compile_cache() -> str:
    """Point torch's inductor caches at the user's cache folder unless `TORCHINDUCTOR_CACHE_DIR` is set; the folder."""
    if not os.environ.get(CACHE_VARIABLE):
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        os.environ[CACHE_VARIABLE] = str(Path(base) / "diffusion-rl" / "torchinductor")
    return os.environ[CACHE_VARIABLE]


def compile_seconds() -> float:
    """Seconds this process has spent compiling with torch.compile so far (dynamo's tally; 0 where it keeps none)."""
    from torch._dynamo import utils

    spent = getattr(utils, "calculate_time_spent", None)
    return float(spent().get("total_wall_time", 0.0)) if spent is not None else 0.0


class CompileReport:
    """Says once, after the first update that compiled, how long compiling took and where torch keeps the result."""

    def __init__(self, enabled: bool):
        self.pending = enabled

    def after_update(self) -> None:
        if not self.pending:
            return
        self.pending = False
        logger.info(
            "model.compile_blocks: %.0f s compiling the transformer's blocks (torch's caches in %s; a later run of "
            "the same shapes reuses them)",
            compile_seconds(),
            os.environ.get(CACHE_VARIABLE, "torch's default folder"),
        )
