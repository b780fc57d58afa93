"""`motion`: how much a video moves, up to a target amount (image-to-video: the first frame alone scores 0).

The score is min(c, target) / target in [0, 1], where c is the mean absolute pixel change between consecutive
frames in [0, 1] of the pixel range (rewards/video.py `frame_change`): a still video scores 0, a video that changes
by `target` or more per frame scores 1. The cap is what keeps noise from paying: past the target, more change earns
nothing, so pair it with a reward that more change would lose (`source_preservation` of the first frame, a
per-frame quality reward). Scores videos only (`video = True`).
"""

from __future__ import annotations

import numpy as np

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS, RewardFn
from diffusion_rl.rewards.video import frame_change


@REWARDS.register("motion")
def motion(target: float = 0.05) -> RewardFn:
    """min(mean change between consecutive frames, target) / target; target in (0, 1], of the pixel range."""
    if not 0 < target <= 1:
        raise UserError(f"motion: target {target!r} must be in (0, 1] (a fraction of the pixel range per frame)")

    def reward(images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        if images.ndim != 5 or images.shape[1] < 2:
            raise ValueError(f"motion scores videos of at least 2 frames [B, F, H, W, 3], got {images.shape}")
        return (np.minimum(frame_change(images), target) / target).astype(np.float32)

    reward.video = True
    return reward
