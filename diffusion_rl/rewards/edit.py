"""`source_preservation`: how much of an edit's source image the result keeps (an edit should change only what it was
asked to).

The source is the sample's condition image (metadata["condition_images"][source_index], at the output size, as the
model saw it; data/condition_images.py). Metrics:
- `pixel`: 1 − mean |result − source| / 255 over every pixel and channel (1 for an unchanged image);
- `clip`: the cosine similarity of the two images' CLIP image embeddings (a CLIPModel directory as `path`), which
  forgives small shifts and colour changes that pixels do not.
It rewards doing nothing at all, so weigh it against a reward for the edit itself (the `vlm` judge in mode `edit`,
or `shapes_edit` on ShapesWorld). A sample without condition images fails (NaN).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diffusion_rl.data.condition_images import METADATA_KEY
from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS, RewardFn

METRICS = ("pixel", "clip")


def source_of(metadata: dict[str, Any], index: int, like: np.ndarray) -> np.ndarray:
    """The sample's condition image `index`, which must have the result's shape."""
    sources = metadata.get(METADATA_KEY) or []
    if len(sources) <= index:
        raise ValueError(f"the sample has {len(sources)} condition images; source_preservation reads number {index}")
    source = np.asarray(sources[index])
    if source.shape != like.shape:
        raise ValueError(f"the condition image {source.shape} and the result {like.shape} differ in size")
    return source


def pixel_similarity(results: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """float32 [B]: 1 − mean |a − b| / 255 per pair of uint8 images."""
    difference = np.abs(results.astype(np.float64) - sources.astype(np.float64)) / 255.0
    return (1.0 - difference.reshape(len(results), -1).mean(axis=1)).astype(np.float32)


@REWARDS.register("source_preservation")
def source_preservation(
    metric: str = "pixel", source_index: int = 0, path: str | None = None, **clip_kwargs: Any
) -> RewardFn:
    """Similarity of the result to its source (see the module docstring). metric: pixel or clip; path: the CLIP
    model directory (clip); clip_kwargs: ClipEncoder's device, batch_size, dtype, processor_path."""
    if metric not in METRICS:
        raise UserError(f"source_preservation: metric {metric!r}; known: {', '.join(METRICS)}")
    if metric == "clip" and not path:
        raise UserError("source_preservation: metric clip needs `path`, a CLIPModel directory")
    if metric == "pixel" and (path or clip_kwargs):
        raise UserError("source_preservation: path and CLIP settings go with metric clip")
    encoder = None
    if metric == "clip":
        from diffusion_rl.rewards.clip import ClipEncoder

        encoder = ClipEncoder(path, **clip_kwargs)

    def reward(images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        sources = np.stack([source_of(m, source_index, image) for m, image in zip(metadata, images)])
        if encoder is None:
            return pixel_similarity(images, sources)
        cosines = (encoder.image_embeddings(images) * encoder.image_embeddings(sources)).sum(-1)
        return cosines.cpu().numpy().astype(np.float32)

    return reward
