"""`source_preservation`: how much of an edit's source image the result keeps (an edit should change only what it was
asked to).

The source is the sample's condition image (metadata["condition_images"][source_index], at the output size, as the
model saw it; data/condition_images.py). Metrics:
- `pixel`: 1 − mean |result − source| / 255 over every pixel and channel (1 for an unchanged image);
- `clip`: the cosine similarity of the two images' CLIP image embeddings (a CLIPModel directory as `path`), which
  forgives small shifts and colour changes that pixels do not.
It rewards doing nothing at all, so weigh it against a reward for the edit itself (the `vlm` judge in mode `edit`,
or `shapes_edit` on ShapesWorld). With `outside: shapes_edit` (pixel metric) only the pixels outside the ShapesWorld
edit's region count (rewards/shapes_edit.py `edit_region`): what the instruction leaves alone must stay, and the
edited object is scored by `shapes_edit` alone rather than pulled back to the source. A sample without condition
images fails (NaN).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diffusion_rl.data.condition_images import METADATA_KEY
from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS, RewardFn

METRICS = ("pixel", "clip")
OUTSIDE = ("shapes_edit",)  # edit regions `outside` can leave out


def source_of(metadata: dict[str, Any], index: int, like: np.ndarray) -> np.ndarray:
    """The sample's condition image `index`, which must have the result's shape."""
    sources = metadata.get(METADATA_KEY) or []
    if len(sources) <= index:
        raise ValueError(f"the sample has {len(sources)} condition images; source_preservation reads number {index}")
    source = np.asarray(sources[index])
    if source.shape != like.shape:
        raise ValueError(f"the condition image {source.shape} and the result {like.shape} differ in size")
    return source


def pixel_similarity(results: np.ndarray, sources: np.ndarray, keep_BHW: np.ndarray | None = None) -> np.ndarray:
    """float32 [B]: 1 − mean |a − b| / 255 per pair of uint8 images, over the pixels keep_BHW marks (all by
    default; 1 where it marks none)."""
    difference_BHW = (np.abs(results.astype(np.float64) - sources.astype(np.float64)) / 255.0).mean(axis=-1)
    keep_BHW = np.ones(difference_BHW.shape, dtype=bool) if keep_BHW is None else keep_BHW
    kept = keep_BHW.reshape(len(results), -1).sum(axis=1)
    lost = (difference_BHW * keep_BHW).reshape(len(results), -1).sum(axis=1)
    return (1.0 - lost / np.maximum(kept, 1)).astype(np.float32)


def _regions_outside(outside: str, metadata: list[dict], images: np.ndarray) -> np.ndarray:
    """bool [B, H, W]: the pixels outside each sample's edit region."""
    from diffusion_rl.rewards.shapes_edit import edit_region, spec_of

    height, width = images.shape[1:3]
    return ~np.stack([edit_region(spec_of(m), height, width) for m in metadata])


@REWARDS.register("source_preservation")
def source_preservation(
    metric: str = "pixel",
    source_index: int = 0,
    path: str | None = None,
    outside: str | None = None,
    **clip_kwargs: Any,
) -> RewardFn:
    """Similarity of the result to its source (see the module docstring). metric: pixel or clip; path: the CLIP
    model directory (clip); outside: shapes_edit to score only outside the edit's region (pixel); clip_kwargs:
    ClipEncoder's device, batch_size, dtype, processor_path."""
    if metric not in METRICS:
        raise UserError(f"source_preservation: metric {metric!r}; known: {', '.join(METRICS)}")
    if outside is not None and (outside not in OUTSIDE or metric != "pixel"):
        raise UserError(
            f"source_preservation: outside {outside!r} with metric {metric!r}; outside takes {', '.join(OUTSIDE)}, "
            "with metric pixel"
        )
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
            keep = None if outside is None else _regions_outside(outside, metadata, images)
            return pixel_similarity(images, sources, keep)
        cosines = (encoder.image_embeddings(images) * encoder.image_embeddings(sources)).sum(-1)
        return cosines.cpu().numpy().astype(np.float32)

    return reward
