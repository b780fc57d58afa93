"""The pairwise preference of configs/quickstart_pairwise.yaml: a stand-in for a VLM judge that runs offline on a CPU.

`prefer(images_a, images_b, prompts, metadata)` returns, for each pair k, P(image a_k is better than image b_k):
a Bradley-Terry probability from the two images' JPEG sizes (quality 95, as `jpeg_compressibility` measures them),

    P(a better than b) = sigmoid((bytes(b) - bytes(a)) / temperature)

so the smaller file wins, surely when the two differ by many times `temperature` bytes and at even odds when they are
equal. A real judge (the `vlm` reward with mode: pairwise) is called the same way; `pairwise_win_rate` averages
these probabilities into each sample's win rate within its group (Pref-GRPO).
"""

import math

import numpy as np

from diffusion_rl.rewards.jpeg import jpeg_size_kb


def prefer(images_a, images_b, prompts, metadata, temperature: float = 5.0):
    """P(a better than b) [N] for uint8 images [N, H, W, 3]; temperature in bytes (> 0)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 bytes, got {temperature}")
    out = np.empty(len(images_a), dtype=np.float32)
    for k, (a, b) in enumerate(zip(images_a, images_b)):
        margin = (jpeg_size_kb(b) - jpeg_size_kb(a)) * 1000 / temperature
        out[k] = 1.0 / (1.0 + math.exp(-max(min(margin, 60.0), -60.0)))  # clipped: exp stays finite
    return out
