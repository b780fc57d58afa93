"""Guard statistics on tiny images, against numbers worked out by hand."""

import math

import numpy as np
import pytest

from diffusion_rl.guard import stats
from diffusion_rl.rewards.jpeg import jpeg_size_kb

# one pure red, green and blue pixel and a black one
RGBK = np.array([[[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [0, 0, 0]]]], dtype=np.uint8)


def _flat(value, size=4):
    return np.full((size, size, 3), value, dtype=np.uint8)


def test_brightness_dark_and_saturated_fractions_by_hand():
    # luma: 0.299·255 + 0.587·255 + 0.114·255 + 0 = 255 in all -> mean 63.75 -> 0.25 of full scale
    assert stats.brightness(RGBK)[0] == pytest.approx(0.25)
    assert stats.dark_fraction(RGBK)[0] == 0.25  # the black pixel only (the blue one has luma 29.07 ≥ 16)
    assert stats.saturated_fraction(RGBK)[0] == 0.75  # red, green and blue each have a channel at 255


def test_colorfulness_by_hand():
    # rg = R − G = 255, −255, 0, 0 (mean 0, variance 2·255²/4); yb = (R + G)/2 − B = 127.5, 127.5, −255, 0 (mean 0,
    # variance (2·127.5² + 255²)/4); M = sqrt(var_rg + var_yb) + 0.3 · 0
    expected = math.sqrt(2 * 255**2 / 4 + (2 * 127.5**2 + 255**2) / 4)
    assert stats.colorfulness(RGBK)[0] == pytest.approx(expected)
    assert expected == pytest.approx(238.53, abs=0.01)
    # a flat orange image: no spread, offset sqrt(μ_rg² + μ_yb²) with rg = 100, yb = 150 − 0
    assert stats.colorfulness(_flat((200, 100, 0))[None])[0] == pytest.approx(0.3 * math.hypot(100, 150))


def test_edge_density_by_hand():
    # 3 rows of columns 0 0 0 255 255: the interior row's x = 1, 2, 3 see (Y[x+1] − Y[x−1]) / 2 / 255 = 0, ½, ½
    image = np.zeros((3, 5, 3), dtype=np.uint8)
    image[:, 3:] = 255
    assert stats.edge_density(image[None])[0] == pytest.approx(2 / 3)
    # a gentle ramp 0, 10, 20: gradient (20 − 0) / 2 / 255 = 0.039, below the 0.05 threshold
    ramp = np.repeat(np.array([0, 10, 20], dtype=np.uint8)[None, :, None], 3, axis=0).repeat(3, axis=2)
    assert stats.edge_density(ramp[None])[0] == 0.0


def test_jpeg_kb_is_what_the_jpeg_reward_measures():
    image = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    assert stats.jpeg_kb(image[None])[0] == pytest.approx(jpeg_size_kb(image))


def test_group_diversity_by_hand():
    images = np.stack([_flat(0), _flat(51), _flat(255), _flat(100), _flat(100), _flat(7)])
    groups = np.array([0, 0, 0, 1, 1, 2])
    # group 0: pairs 51/255 = 0.2, 255/255 = 1, 204/255 = 0.8 -> 2/3; group 1: identical -> 0; group 2: alone, skipped
    assert stats.group_diversity(images, groups) == pytest.approx((2 / 3 + 0) / 2)
    assert stats.group_diversity(images[:1], np.array([0])) is None


def test_val_drift_by_hand_and_shape_check():
    assert stats.val_drift(np.stack([_flat(10), _flat(40)]), np.stack([_flat(30), _flat(40)])) == pytest.approx(
        (20 / 255 + 0) / 2
    )
    with pytest.raises(ValueError, match="differ in shape"):
        stats.val_drift(np.stack([_flat(10)]), np.stack([_flat(10), _flat(10)]))


def test_shrink_keeps_aspect_and_leaves_small_images():
    wide = np.zeros((2, 256, 512, 3), dtype=np.uint8)
    assert stats.shrink(wide, 256).shape == (2, 128, 256, 3)
    assert stats.shrink(wide, 512) is wide


def test_rollout_stats_are_batch_means():
    images = np.stack([_flat(0), _flat(255)])
    values = stats.rollout_stats(images, np.array([0, 0]))
    assert values["brightness"] == pytest.approx(0.5)
    assert values["dark_fraction"] == pytest.approx(0.5)
    assert values["saturated_fraction"] == pytest.approx(0.5)
    assert values["group_diversity"] == pytest.approx(1.0)
    assert set(values) == set(stats.ROLLOUT_STATS)
    assert set(stats.rollout_stats(images, np.array([0, 1]), ("brightness", "group_diversity"))) == {"brightness"}
