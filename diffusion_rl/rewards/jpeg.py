"""JPEG file-size rewards, defined as in Flow-GRPO.

- `jpeg_incompressibility`: size of the image saved as JPEG at quality 95, in kB (bytes / 1000). Higher = more
  detail.
- `jpeg_compressibility`: -size_kB / 500. Higher = simpler image.

Scale caveat: at 64 px a JPEG is ~1-3 kB, so the within-batch spread of -kB/500 is ~5e-5, below the default
advantage eps (1e-4): the advantage (r - mean) / (std + eps) is then damped by eps rather than normalised by std.
For tiny images use `jpeg_incompressibility` (spread ~0.03 kB), or set a smaller eps.
"""

import io

import numpy as np
from PIL import Image

from diffusion_rl.rewards.base import REWARDS, RewardFn

JPEG_QUALITY = 95


def jpeg_size_kb(image_HW3: np.ndarray) -> float:
    """Size in kB (1000 bytes) of one uint8 RGB image saved as JPEG at quality 95, in memory."""
    buffer = io.BytesIO()
    Image.fromarray(image_HW3).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.tell() / 1000


def _sizes_kb(images: np.ndarray) -> np.ndarray:
    return np.array([jpeg_size_kb(image) for image in images], dtype=np.float32)


@REWARDS.register("jpeg_incompressibility")
def jpeg_incompressibility() -> RewardFn:
    """Reward = JPEG size in kB."""

    def reward(images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        return _sizes_kb(images)

    return reward


@REWARDS.register("jpeg_compressibility")
def jpeg_compressibility() -> RewardFn:
    """Reward = -(JPEG size in kB) / 500."""

    def reward(images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        return (-_sizes_kb(images) / 500).astype(np.float32)

    return reward
