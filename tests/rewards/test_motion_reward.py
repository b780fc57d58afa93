"""The `motion` reward against numbers worked by hand, and what it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import make_reward


def test_motion_is_the_capped_mean_change_between_frames():
    videos = np.zeros((3, 3, 2, 2, 3), dtype=np.uint8)
    videos[1, 1:] = 51  # one step of 51/255 = 0.2 on every pixel, then none: mean over 2 steps 0.1
    videos[2, 1] = 5  # 5/255 up then 5/255 down on one frame: (5 + 5) / 255 / 2 = 0.0196…
    scores = make_reward("motion", target=0.05)(videos, [""] * 3, [{}] * 3)
    assert scores.dtype == np.float32
    assert scores.tolist() == pytest.approx([0.0, 1.0, (10 / 255 / 2) / 0.05], abs=1e-6)  # still; capped; 0.392
    assert make_reward("motion", target=0.2)(videos[1:2], [""], [{}]).tolist() == pytest.approx([0.5])


def test_motion_refuses_images_and_a_target_outside_the_pixel_range():
    with pytest.raises(ValueError, match="videos of at least 2 frames"):
        make_reward("motion")(np.zeros((1, 4, 4, 3), dtype=np.uint8), [""], [{}])
    with pytest.raises(UserError, match="target 0 must be in"):
        make_reward("motion", target=0)
