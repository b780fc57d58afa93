"""The tracker interface, value checks shared by the backends, and the fan-out tracker."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from diffusion_rl.tracking.video import check_video

logger = logging.getLogger(__name__)


@runtime_checkable
class Tracker(Protocol):
    """Where metrics and sample images go. Steps are optimizer steps; a step may be logged by several calls.

    A tracker may also define `resume_from(step: int)`, called once before logging so it can drop what an earlier
    run in the folder logged after that step (the resumed checkpoint's; -1 for a start from scratch: everything),
    and again after a recovery (MultiTracker forwards it to those that have it).
    """

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_images(self, tag: str, image: np.ndarray, step: int, caption: str = "") -> None: ...

    def log_video(self, tag: str, video: np.ndarray, step: int, caption: str = "", fps: float = 8) -> None:
        """A video uint8 [F, H, W, 3] (e.g. a grid of validation videos, tracking/video.py)."""

    def close(self) -> None: ...


def to_scalar(name: str, value: Any) -> int | float:
    """A python int or float from an int/float, a numpy scalar or a one-element tensor/array.

    bools become ints. NaN and inf are returned as they are; each backend decides how to store them.
    """
    if isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)  # numpy scalars/arrays and torch tensors
    if callable(item):
        try:
            return to_scalar(name, item())
        except (ValueError, RuntimeError):  # more than one element
            pass
    raise TypeError(f"metric {name!r} must be a number (or a one-element tensor), got {type(value).__name__}")


def is_finite(value: int | float) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def check_image(tag: str, image: Any) -> np.ndarray:
    """The image itself if it is a uint8 [H, W, 3] numpy array; a ValueError saying what it is otherwise."""
    if not isinstance(image, np.ndarray):
        raise TypeError(f"image {tag!r} must be a numpy uint8 array [H, W, 3], got {type(image).__name__}")
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image {tag!r} must be uint8 [H, W, 3], got {image.dtype} {list(image.shape)}")
    return image


class MultiTracker:
    """Sends every call to each tracker in turn. An error in one propagates (after `close`, all are closed)."""

    def __init__(self, trackers: Iterable[Tracker]) -> None:
        self.trackers: list[Tracker] = list(trackers)
        self._closed = False

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step)

    def log_images(self, tag: str, image: np.ndarray, step: int, caption: str = "") -> None:
        check_image(tag, image)
        for tracker in self.trackers:
            tracker.log_images(tag, image, step, caption)

    def log_video(self, tag: str, video: np.ndarray, step: int, caption: str = "", fps: float = 8) -> None:
        check_video(tag, video)
        for tracker in self.trackers:
            tracker.log_video(tag, video, step, caption, fps)

    def resume_from(self, step: int) -> None:
        """Forwarded to the trackers that define `resume_from` (e.g. JSONL drops rows after `step`)."""
        for tracker in self.trackers:
            resume = getattr(tracker, "resume_from", None)
            if resume is not None:
                resume(step)

    def close(self) -> None:
        """Closes every tracker, even if some raise; then raises the first error. Closing twice is a no-op."""
        if self._closed:
            return
        self._closed = True
        first_error: BaseException | None = None
        for tracker in self.trackers:
            try:
                tracker.close()
            except BaseException as error:  # re-raised below, once the others are closed
                if first_error is None:
                    first_error = error
                else:
                    logger.error("closing %s also failed: %r", type(tracker).__name__, error)
        if first_error is not None:
            raise first_error

    def __enter__(self) -> MultiTracker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
