"""Samples as files and sheets, whether they are images or videos, edits or not: one rule for every output.

- an image sample (uint8 [H, W, 3]) is a PNG; a video sample ([F, H, W, 3]) an animated WebP (tracking/video.py);
- a sheet of samples is an image grid, or a video grid (the grid of every frame) for videos;
- an edit's tile shows its condition images, then the result, left to right (source → result), each at the output
  size, split by a thin white bar.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diffusion_rl.tracking.images import GAP, image_grid, save_png
from diffusion_rl.tracking.video import save_video, video_grid

VIDEO_SUFFIX = ".webp"  # animated, lossless; every browser and TensorBoard's file viewer shows it


def is_video(samples: np.ndarray) -> bool:
    """Whether a batch of samples ([N, H, W, 3] images or [N, F, H, W, 3] videos) holds videos."""
    return samples.ndim == 5


def with_sources(results: np.ndarray, sources: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
    """uint8 [N, H, (k + 1)·W + k·GAP, 3]: row i's k condition images, then its result, side by side (videos
    [N, F, H, …]: each condition image held still beside every frame, e.g. an image-to-video's first frame)."""
    if len(sources) != len(results):
        raise ValueError(f"{len(results)} results but {len(sources)} rows of condition images")
    frame = results.shape[2:] if is_video(results) else results.shape[1:]  # (H, W, 3)
    width_axis = 2 if is_video(results) else 1
    bar = np.full((frame[0], GAP, 3), 255, dtype=np.uint8)
    tiles = []
    for result, row in zip(results, sources):
        parts = []
        for image in row:
            if image.shape != frame:
                raise ValueError(f"a condition image {image.shape} differs from its result's frames {frame}")
            parts += [image, bar]
        if is_video(results):
            parts = [np.broadcast_to(part, (len(result), *part.shape)) for part in parts]
        tiles.append(np.concatenate([*parts, result], axis=width_axis))
    widths = {tile.shape[1] for tile in tiles}
    if len(widths) > 1:
        raise ValueError("the rows of a sheet carry different numbers of condition images")
    return np.stack(tiles)


def sample_sheet(
    samples: np.ndarray,
    captions: Sequence[str] | None = None,
    ncols: int | None = None,
    sources: Sequence[Sequence[np.ndarray]] | None = None,
) -> np.ndarray:
    """The labelled grid of a batch: uint8 [H', W', 3] for images, [F, H', W', 3] for videos; with `sources`
    (an edit's condition images per row) each tile reads source → result."""
    if sources is not None and any(len(row) for row in sources):
        samples = with_sources(samples, sources)
    return video_grid(samples, captions, ncols) if is_video(samples) else image_grid(samples, captions, ncols)


def save_sample(sample: np.ndarray, stem: str | os.PathLike[str]) -> Path:
    """One sample (or sheet) at `stem` + .png (an image [H, W, 3]) or + .webp (a video [F, H, W, 3])."""
    stem = Path(stem)
    if sample.ndim == 4:
        return save_video(sample, stem.with_name(stem.name + VIDEO_SUFFIX))
    return save_png(sample, stem.with_name(stem.name + ".png"))


def log_sheet(trackers, tag: str, sheet: np.ndarray, step: int, caption: str = "") -> None:
    """A sheet to the trackers: an image, or a video when it has frames."""
    if sheet.ndim == 4:
        trackers.log_video(tag, sheet, step, caption=caption)
    else:
        trackers.log_images(tag, sheet, step, caption=caption)
