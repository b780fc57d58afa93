"""Rewards of videos: any image reward applied frame by frame, and the temporal-consistency reward.

A video reaches a reward as uint8 [B, F, H, W, 3]. A reward that scores whole videos says so with the attribute
`video = True` (like `temporal_consistency`, or a user function given that attribute); every other reward is an
image reward, and `framewise` applies it to the frames with the config's reduction (`rewards.N.frames`):

- `mean`: the mean of the frames' scores; `min`: the worst frame's;
- `first` / `last`: the first / last frame's score (only that frame is scored).

A frame the reward fails on (NaN) fails its video. Images ([B, H, W, 3]) pass through unchanged, so a wrapped
reward scores images and videos alike. A group reward is applied frame by frame too: `score_group` is called once
per frame index with that frame of every video of the group.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS, RewardFn, check_reward_output, is_group_reward

FRAME_REDUCTIONS = ("mean", "min", "first", "last")


def takes_video(fn: Any) -> bool:
    """Whether `fn` scores whole videos itself (`video = True`) rather than images."""
    return getattr(fn, "video", False) is True


def reduce_frames(scores_BF: np.ndarray, reduction: str) -> np.ndarray:
    """float32 [B]: each row's frame scores reduced (NaN in a row gives NaN: a failed frame fails the video)."""
    if reduction == "mean":
        return scores_BF.mean(axis=1).astype(np.float32)
    if reduction == "min":
        return scores_BF.min(axis=1).astype(np.float32)  # np.min propagates NaN
    if reduction == "first":
        return scores_BF[:, 0].astype(np.float32)
    if reduction == "last":
        return scores_BF[:, -1].astype(np.float32)
    raise ValueError(f"unknown frame reduction {reduction!r}; known: {', '.join(FRAME_REDUCTIONS)}")


def _frames_to_score(num_frames: int, reduction: str) -> list[int]:
    """The frame indices whose scores the reduction needs."""
    if reduction == "first":
        return [0]
    if reduction == "last":
        return [num_frames - 1]
    return list(range(num_frames))


class FramewiseReward:
    """An image reward applied to each frame of a video, its frame scores reduced to one score per video."""

    def __init__(self, fn: RewardFn, reduction: str, name: str):
        if reduction not in FRAME_REDUCTIONS:
            raise UserError(f"reward '{name}': frames={reduction!r}; known: {', '.join(FRAME_REDUCTIONS)}")
        self.fn, self.reduction, self.name = fn, reduction, name
        if is_group_reward(fn):
            self.group = True  # the combiner calls score_group once per group (rewards/base.py)

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        if images.ndim != 5:
            return self.fn(images, prompts, metadata)
        B = len(images)
        frames = _frames_to_score(images.shape[1], self.reduction)
        flat = images[:, frames].reshape(B * len(frames), *images.shape[2:])  # [B·F', H, W, 3], video-major
        prompts_f = [p for p in prompts for _ in frames]
        metadata_f = [dict(m) for m in metadata for _ in frames]  # a copy per frame: a reward may change its own
        scores = check_reward_output(self.name, self.fn(flat, prompts_f, metadata_f), B * len(frames))
        return reduce_frames(scores.reshape(B, len(frames)), self.reduction)

    def score_group(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        if images.ndim != 5:
            return self.fn.score_group(images, prompts, metadata)
        frames = _frames_to_score(images.shape[1], self.reduction)
        per_frame = [self.fn.score_group(images[:, f], prompts, metadata) for f in frames]
        per_frame = [check_reward_output(self.name, scores, len(images)) for scores in per_frame]
        return reduce_frames(np.stack(per_frame, axis=1), self.reduction)


def framewise(fn: RewardFn, reduction: str, name: str) -> RewardFn:
    """`fn` as it scores videos: itself when it takes videos (`video = True`), else frame by frame."""
    return fn if takes_video(fn) else FramewiseReward(fn, reduction, name)


# ---------------------------------------------------------------------------------------------------------------
# temporal consistency


def frame_change(video_BFHW3: np.ndarray) -> np.ndarray:
    """float64 [B]: the mean absolute change between consecutive frames, in [0, 1] of the pixel range."""
    frames = video_BFHW3.astype(np.float64) / 255.0
    return np.abs(np.diff(frames, axis=1)).mean(axis=(1, 2, 3, 4))


@REWARDS.register("temporal_consistency")
def temporal_consistency() -> RewardFn:
    """1 − the mean absolute pixel change between consecutive frames (in [0, 1]; 1 for a still video).

    Scores videos only (an image has no frames to compare: a ValueError). A still video scores 1, so pair it with
    a reward for the content (it alone is maximised by freezing the first frame).
    """

    def reward(images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        if images.ndim != 5 or images.shape[1] < 2:
            raise ValueError(
                f"temporal_consistency scores videos of at least 2 frames [B, F, H, W, 3], got {images.shape}"
            )
        return (1.0 - frame_change(images)).astype(np.float32)

    reward.video = True
    return reward
