"""The shared signature of direct-preference / forward-process losses, registered in PREFERENCE_LOSSES.

These losses train on the final clean latents x0 of rollouts, re-noised by the forward process
x_t = (1 - t) * x0 + t * eps with fresh eps, instead of on the sampler's per-step log-probs. Each loss is
`fn(inp, cfg) -> LossOutput` where `inp` is that loss's own input dataclass (named by the function's
`input_type` attribute) and `cfg` is any object carrying the attributes the loss documents.

Conventions shared by every input: tensors the loss trains through carry grad; "old", reference and EMA
predictions are computed by the caller under no_grad (the losses detach them anyway). Velocities are the
model's conditional predictions (guidance 1).
"""

from collections.abc import Callable
from typing import Any

import torch

from diffusion_rl.algorithms.losses.base import LossOutput
from diffusion_rl.registry import Registry

PreferenceLossFn = Callable[[Any, Any], LossOutput]

PREFERENCE_LOSSES: Registry[PreferenceLossFn] = Registry("preference loss")


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N]: the mean over every non-batch dim."""
    return x.flatten(1).mean(dim=1)


def batch_rows(name: str, x: torch.Tensor) -> int:
    """N of a [N, ...] tensor with at least 2 dims; a clear error otherwise."""
    if x.ndim < 2:
        raise ValueError(f"{name} must be [N, ...] with at least 2 dims; got {tuple(x.shape)}")
    return x.shape[0]


def check_vectors(batch: int, **tensors: torch.Tensor | None) -> None:
    """Every given tensor must be [batch]; None is skipped."""
    for name, value in tensors.items():
        if value is not None and tuple(value.shape) != (batch,):
            raise ValueError(f"{name} must be [N] = ({batch},); got {tuple(value.shape)}")


def check_same_shape(like: torch.Tensor, like_name: str, **tensors: torch.Tensor | None) -> None:
    for name, value in tensors.items():
        if value is not None and value.shape != like.shape:
            raise ValueError(f"{name} {tuple(value.shape)} must have {like_name}'s shape {tuple(like.shape)}")


def detached(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in metrics.items()}
