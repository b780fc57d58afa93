import io

import numpy as np
import pytest
from PIL import Image

from diffusion_rl.rewards import make_reward


def _jpeg_bytes(image: np.ndarray) -> int:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95)
    return len(buffer.getvalue())


@pytest.fixture
def images() -> np.ndarray:
    rng = np.random.default_rng(0)
    flat = np.full((32, 48, 3), 128, dtype=np.uint8)
    noise = rng.integers(0, 256, size=(32, 48, 3), dtype=np.uint8)
    gradient = np.broadcast_to(np.linspace(0, 255, 48, dtype=np.uint8)[None, :, None], (32, 48, 3)).copy()
    return np.stack([flat, noise, gradient])


def test_jpeg_incompressibility_is_jpeg_size_in_kb(images):
    reward = make_reward("jpeg_incompressibility")
    scores = reward(images, ["a", "b", "c"], [{}, {}, {}])
    expected = [_jpeg_bytes(image) / 1000 for image in images]
    assert scores.dtype == np.float32 and scores.shape == (3,)
    np.testing.assert_allclose(scores, expected, rtol=1e-6)


def test_jpeg_compressibility_is_minus_size_kb_over_500(images):
    reward = make_reward("jpeg_compressibility")
    scores = reward(images, ["a", "b", "c"], [{}, {}, {}])
    expected = [-(_jpeg_bytes(image) / 1000) / 500 for image in images]
    assert scores.dtype == np.float32
    np.testing.assert_allclose(scores, expected, rtol=1e-6)


def test_flat_image_compresses_better_than_noise(images):
    flat_and_noise = images[:2]
    incompressibility = make_reward("jpeg_incompressibility")(flat_and_noise, ["", ""], [{}, {}])
    compressibility = make_reward("jpeg_compressibility")(flat_and_noise, ["", ""], [{}, {}])
    assert incompressibility[0] < incompressibility[1]
    assert compressibility[0] > compressibility[1]
