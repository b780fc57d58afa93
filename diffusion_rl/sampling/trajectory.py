"""What a rollout produced: a typed batch that stays on the worker that sampled it until the update is done.

B rows (samples); W = the SDE window's steps (the trained ones). An ODE rollout (no window) has W = 0 and its
per-step fields are None. Latents keep the model's own layout ([C, H, W] for SD3, a token grid for FLUX and
Qwen-Image, [C, F, H, W] for video): the step functions and losses reduce over every non-batch dimension.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, tensorclass

from diffusion_rl.data.sampler import SampleIds


@tensorclass
class Trajectory:
    """A rollout, as `sampling.rollout.rollout` returns it (offline data: `final_latents`, `cond`, `ids` only)."""

    final_latents: torch.Tensor  # [B, …] fp32: the clean latents at σ = 0, which `images` decode from
    cond: TensorDict  # [B]: the model's conditioning (text embeddings, negatives for CFG, condition images)
    ids: SampleIds  # [B]
    images: torch.Tensor | None = None  # uint8 [B, H, W, 3]; None for offline latents
    # [B, W+1, …] fp32, or sampling.latents_dtype (sampling/rollout.py): x before each window step, and after the last
    latents: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None  # [B, W] fp32: log π_rollout(x_{j+1} | x_j), mean over latent elements
    means: torch.Tensor | None = None  # [B, W, …] fp32 or sampling.latents_dtype: each window step's Gaussian mean
    stds: torch.Tensor | None = None  # [B, W] fp32: each window step's std as its step type defines it
    sigmas: torch.Tensor | None = None  # [B, W] fp32: σ_j of each window step
    sigmas_next: torch.Tensor | None = None  # [B, W] fp32: σ_{j+1}
    step_index: torch.Tensor | None = None  # [B, W] long: each window step's position in the schedule
    # [B] fp32: transformer forwards the rollout spent per row (a tree's shared nodes split among their leaves)
    nfe: torch.Tensor | None = None

    @property
    def window_size(self) -> int:
        """W: the number of SDE steps recorded (0 for an ODE rollout)."""
        return 0 if self.log_probs is None else self.log_probs.shape[1]

    def generated(self) -> Generated:
        """What the driver gets back of a training rollout: its images (CPU) and which rows are finite."""
        nfe = torch.zeros(self.batch_size[0]) if self.nfe is None else self.nfe.float().cpu()
        return Generated(images=self.images.cpu(), finite=self.finite_rows().cpu(), nfe=nfe, batch_size=self.batch_size)

    def finite_rows(self) -> torch.Tensor:
        """bool [B]: rows whose clean latents (and log-probabilities) are all finite. A NaN latent decodes to a
        black image that looks like a real sample, so a row without this is a failed sample, never scored."""
        finite = torch.isfinite(self.final_latents.flatten(1)).all(dim=1)
        if self.log_probs is not None:
            finite &= torch.isfinite(self.log_probs).all(dim=1)
        return finite


@tensorclass
class Generated:
    """What the driver gets back from a training rollout: the images to score and which of them are usable."""

    images: torch.Tensor  # uint8 [B, H, W, 3] (videos [B, F, H, W, 3]), CPU
    finite: torch.Tensor  # bool [B]: False where the row's latents came out NaN/inf (see Trajectory.finite_rows)
    nfe: torch.Tensor | None = None  # fp32 [B]: transformer forwards spent per row (Trajectory.nfe)

    @classmethod
    def empty(cls, height: int, width: int, frames: int | None = None) -> Generated:
        """No rows (a worker that takes part in a collective without rows of its own); `frames` for a video family."""
        images = torch.zeros(0, *([frames] if frames else []), height, width, 3, dtype=torch.uint8)
        return cls(images=images, finite=torch.zeros(0, dtype=torch.bool), nfe=torch.zeros(0), batch_size=[0])
