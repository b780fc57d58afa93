"""Condition images at the model's door: how many a batch carries, which are the same image, and their latents.

The editing families (Qwen-Image-Edit, FLUX.1 Kontext) get each row's condition images as uint8 [H, W, 3] arrays at
the output size (data/condition_images.py fits them). A step repeats each prompt group_size times, so the same
image comes many times: it is VAE-encoded (and shown to a text encoder) once, recognised by its content.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from diffusion_rl.errors import UserError


def image_key(image: np.ndarray) -> bytes:
    """A digest of an image's pixels and shape: equal for equal images."""
    return hashlib.blake2b(image.tobytes(), digest_size=16).digest() + repr(image.shape).encode()


def condition_count(family: str, images: Sequence[Sequence[np.ndarray]] | None, batch: int, most: int | None) -> int:
    """The number k of condition images every row of a batch of `batch` rows carries (0 when `images` is None), or
    a UserError when rows differ, or carry more than `most` (None: no bound)."""
    if images is None:
        return 0
    if len(images) != batch:
        raise ValueError(f"encode_prompts: {len(images)} rows of condition images for {batch} prompts")
    counts = sorted({len(row) for row in images})
    if len(counts) > 1:
        raise UserError(
            f"the {family} family needs the same number of condition images in every row of a batch, got {counts}"
        )
    if most is not None and counts[0] > most:
        raise UserError(f"the {family} family takes at most {most} condition image(s) per prompt, got {counts[0]}")
    return counts[0]


def distinct_images(images: Sequence[Sequence[np.ndarray]]) -> tuple[list[np.ndarray], torch.Tensor]:
    """The distinct images of a batch of rows (k each) and where each row finds its own: (unique, index [B, k])."""
    position: dict[bytes, int] = {}
    unique: list[np.ndarray] = []
    index = []
    for row in images:
        picks = []
        for image in row:
            key = image_key(image)
            if key not in position:
                position[key] = len(unique)
                unique.append(image)
            picks.append(position[key])
        index.append(picks)
    return unique, torch.tensor(index, dtype=torch.long).reshape(len(images), -1)


VAE_ROWS = 16  # images the VAE encodes or decodes at once: its working set grows with them (~0.4 GiB per 512² image)


def condition_latents(encode, images: Sequence[Sequence[np.ndarray]]) -> torch.Tensor:
    """[B, k, …]: each row's condition images through `encode` (uint8 [N, H, W, 3] → latents [N, …]), each distinct
    image encoded once, VAE_ROWS at a time (48 edit prompts' sources at 1024² at once would hold ~100 GiB)."""
    unique, index = distinct_images(images)
    latents = torch.cat([encode(chunk) for chunk in torch.from_numpy(np.stack(unique)).split(VAE_ROWS)])
    return latents[index.to(latents.device)]
