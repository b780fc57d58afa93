"""`model.attention_backend`: which kernel the transformer's attention runs, through diffusers' attention dispatcher.

`sdpa` (the default) leaves the transformer as diffusers builds it: torch's scaled_dot_product_attention (or what
the DIFFUSERS_ATTN_BACKEND environment variable names). On a CUDA device, `sdpa` keeps torch from choosing its cuDNN
kernel: on an H200 (torch 2.11, CUDA 13) that kernel's backward failed on FLUX.1-dev's LoRA step ("mha_graph.execute
… is_good()", an illegal memory access without CUDA_LAUNCH_BLOCKING) while flash and memory-efficient attention ran
it, and at a smaller size it gave FLUX.1's LoRA non-finite gradients (run 9), while elsewhere it was at most 4 %
faster (benchmarks/RESULTS.md, GPU check); `_native_cudnn` still asks for cuDNN explicitly (not on FLUX.1).
Any other name is one of diffusers' dispatcher backends
(`native`, `_native_math`, `flash`, `_flash_3`, `sage`, `flex`, `xformers`, …), set on this transformer's attention
processors only (diffusers' process-wide active backend is left as it was). Backends that diffusers downloads from
the Hub at first use (`*_hub`) are not offered: a training node may have no network. A backend whose package is
missing is refused when the model loads, naming what is installed; a family whose attention processors do not go
through the dispatcher (SD3's joint attention) refuses any backend but `sdpa`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from diffusion_rl.config.model import DEFAULT_BACKEND, backend_names
from diffusion_rl.errors import UserError

CUDNN_FINDING = ("on an H200 (torch 2.11, CUDA 13) torch's cuDNN attention kernel failed FLUX.1-dev's LoRA backward "
                 "(an illegal memory access at 6 images, non-finite gradients at 2) and was at most 4 % faster on the "
                 "other families (docs/gpu.md)")  # fmt: skip
logger = logging.getLogger(__name__)


def installed_backends() -> list[str]:
    """The names whose packages this machine has (a backend may still need a GPU to run)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    usable = [DEFAULT_BACKEND]
    for name in backend_names()[1:]:
        try:
            _check_attention_backend_requirements(AttentionBackendName(name))
        except RuntimeError:
            continue
        usable.append(name)
    return usable


def set_attention_backend(transformer: nn.Module, name: str, family: str, device: torch.device) -> None:
    """Route `transformer`'s attention through backend `name` (sdpa: leave it as built, without cuDNN on CUDA)."""
    if name == DEFAULT_BACKEND:
        if device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
            torch.backends.cuda.enable_cudnn_sdp(False)  # process-wide: torch has no per-module switch
            logger.info("model.attention_backend=sdpa: torch's cuDNN attention kernel is off (%s); flash and "
                        "memory-efficient attention remain", CUDNN_FINDING)  # fmt: skip
        return
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _AttentionBackendRegistry,
        _check_attention_backend_requirements,
    )

    processors = [getattr(m, "processor", None) for m in transformer.modules()]
    dispatched = [p for p in processors if p is not None and hasattr(p, "_attention_backend")]
    if not dispatched:
        kinds = sorted({type(p).__name__ for p in processors if p is not None})
        raise UserError(
            f"model.attention_backend={name}: the {family} transformer's attention ({', '.join(kinds)}) does not go "
            f"through diffusers' attention dispatcher; use model.attention_backend={DEFAULT_BACKEND}"
        )
    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except RuntimeError as e:
        raise UserError(
            f"model.attention_backend={name} is not usable here ({e}); installed: {', '.join(installed_backends())}"
        ) from None
    if name == "_native_cudnn" and device.type == "cuda":
        logger.warning("model.attention_backend=_native_cudnn: %s; watch train/skipped_updates", CUDNN_FINDING)
    active = _AttentionBackendRegistry._active_backend
    diffusers_logger = logging.getLogger("diffusers.models.modeling_utils")
    level = diffusers_logger.level
    diffusers_logger.setLevel(logging.ERROR)  # not "attention backends are an experimental feature" per load
    try:
        transformer.set_attention_backend(name)
    finally:
        diffusers_logger.setLevel(level)
        _AttentionBackendRegistry.set_active_backend(active)  # this transformer only, not the process
