"""Videos a person can look at: animated WebP or GIF files (PIL, no ffmpeg), MP4 where imageio-ffmpeg is installed,
and labelled video grids (a caption under each tile, on every frame).

A video is uint8 [F, H, W, 3]; a batch of them uint8 [N, F, H, W, 3].
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from diffusion_rl.errors import UserError
from diffusion_rl.tracking.images import image_grid
from diffusion_rl.utils.files import naming

DEFAULT_FPS = 8
ANIMATED_FORMATS = {".webp": "WEBP", ".gif": "GIF"}  # written by PIL; .mp4 needs imageio-ffmpeg


def check_video(tag: str, video) -> np.ndarray:
    """The video itself if it is a uint8 [F, H, W, 3] numpy array with F ≥ 1; a ValueError saying what it is."""
    if not isinstance(video, np.ndarray) or video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3:
        desc = f"{video.dtype} {list(video.shape)}" if isinstance(video, np.ndarray) else type(video).__name__
        raise ValueError(f"video {tag!r} must be uint8 [F, H, W, 3], got {desc}")
    if len(video) == 0:
        raise ValueError(f"video {tag!r} has no frames")
    return video


def encode_animation(video_FHW3: np.ndarray, fmt: str = "GIF", fps: float = DEFAULT_FPS) -> bytes:
    """The frames as an endlessly looping animated GIF or WebP (lossless), as bytes."""
    frames = [Image.fromarray(frame) for frame in check_video("animation", video_FHW3)]
    buffer = io.BytesIO()
    options = {"lossless": True} if fmt == "WEBP" else {}
    frames[0].save(buffer, format=fmt, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0,
                   **options)  # fmt: skip
    return buffer.getvalue()


def save_video(video_FHW3: np.ndarray, path: str | os.PathLike[str], fps: float = DEFAULT_FPS) -> Path:
    """Write a video as its suffix says: .webp or .gif (animated, PIL) or .mp4 (imageio-ffmpeg). Returns the path."""
    path = Path(path)
    suffix = path.suffix.lower()
    check_video(str(path), video_FHW3)
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix not in (*ANIMATED_FORMATS, ".mp4"):
        raise UserError(f"{path}: cannot write a video as '{path.suffix}'; use .webp, .gif or .mp4")
    with naming(path):
        if suffix == ".mp4":
            _write_mp4(video_FHW3, path, fps)
        else:
            path.write_bytes(encode_animation(video_FHW3, ANIMATED_FORMATS[suffix], fps))
    return path


def _write_mp4(video_FHW3: np.ndarray, path: Path, fps: float) -> None:
    try:
        import imageio_ffmpeg
    except ImportError:
        raise UserError(
            f"{path}: writing .mp4 needs imageio-ffmpeg (pip install imageio-ffmpeg); .webp and .gif need nothing"
        ) from None
    height, width = video_FHW3.shape[1:3]
    # H.264 in yuv420p needs even sides: pad the last row/column by repetition
    padded = np.pad(video_FHW3, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")
    writer = imageio_ffmpeg.write_frames(str(path), (padded.shape[2], padded.shape[1]), fps=fps, macro_block_size=1)
    writer.send(None)  # start the encoder
    for frame in padded:
        writer.send(np.ascontiguousarray(frame))
    writer.close()


def read_animation(path: str | os.PathLike[str]) -> np.ndarray:
    """uint8 [F, H, W, 3]: every frame of an animated WebP or GIF (what `save_video` wrote). The encoders store
    identical consecutive frames once, for longer: such a run comes back as one frame."""
    with Image.open(path) as image:
        frames = []
        for index in range(getattr(image, "n_frames", 1)):
            image.seek(index)
            frames.append(np.asarray(image.convert("RGB"), dtype=np.uint8))
    return np.stack(frames)


def video_grid(videos: np.ndarray, captions: Sequence[str] | None = None, ncols: int | None = None) -> np.ndarray:
    """uint8 [F, H', W', 3]: frame f is the image_grid of every video's frame f, each caption under its tile."""
    if not isinstance(videos, np.ndarray) or videos.ndim != 5 or videos.dtype != np.uint8 or videos.shape[-1] != 3:
        desc = f"{videos.dtype} {list(videos.shape)}" if isinstance(videos, np.ndarray) else type(videos).__name__
        raise ValueError(f"video_grid needs uint8 videos [N, F, H, W, 3], got {desc}")
    return np.stack([image_grid(videos[:, f], captions, ncols) for f in range(videos.shape[1])])
