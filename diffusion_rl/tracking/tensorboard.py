"""TensorBoard event files under `<run_dir>/tensorboard`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from diffusion_rl.tracking.base import check_image, to_scalar
from diffusion_rl.tracking.video import check_video, encode_animation

SUBDIR = "tensorboard"


class TensorBoardTracker:
    """Scalars via add_scalar; images via add_image (HWC); each caption via add_text under the image's tag.

    torch's add_text stores text as `<tag>/text_summary`, which keeps it apart from the image: TensorBoard files
    plugin metadata by tag, so text under the image's exact tag would be shown by neither plugin.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.log_dir = Path(run_dir) / SUBDIR
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._purge_step: int | None = None
        self._writer: Any = None  # opened on first use, so resume_from can still set purge_step

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        writer = self._get_writer()
        for name, value in metrics.items():
            writer.add_scalar(name, to_scalar(name, value), global_step=step)
        writer.flush()

    def log_images(self, tag: str, image: np.ndarray, step: int, caption: str = "") -> None:
        writer = self._get_writer()
        writer.add_image(tag, check_image(tag, image), global_step=step, dataformats="HWC")
        if caption:
            writer.add_text(tag, caption, global_step=step)
        writer.flush()

    def log_video(self, tag: str, video: np.ndarray, step: int, caption: str = "", fps: float = 8) -> None:
        """An animated GIF in the images tab (what torch's add_video writes, without needing moviepy)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        frames, height, width = check_video(tag, video).shape[:3]
        gif = Summary.Image(
            height=height, width=width, colorspace=3, encoded_image_string=encode_animation(video, fps=fps)
        )
        writer = self._get_writer()
        writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=gif)]), step)
        if caption:
            writer.add_text(tag, caption, global_step=step)
        writer.flush()

    def resume_from(self, step: int) -> None:
        """Hides events after `step` left by a crashed run (TensorBoard's purge_step; -1: all of them), so curves do
        not fold back."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._purge_step = step + 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _get_writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # slow import, only when used

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self._purge_step)
        return self._writer
