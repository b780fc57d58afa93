import logging

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from diffusion_rl.errors import UserError
from diffusion_rl.rewards import make_reward

pytest.importorskip("rapidocr")


def render_text(text: str, size: int = 128) -> np.ndarray:
    """Black DejaVu Sans Bold text, centred on a white square, as wide as ~80% of the image at most."""
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    font_size = size // 6
    while True:
        font = ImageFont.truetype("DejaVuSans-Bold.ttf", font_size)
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        if right - left <= 0.8 * size or font_size <= 6:
            break
        font_size -= 1
    draw.text(((size - (right - left)) / 2 - left, (size - (bottom - top)) / 2 - top), text, fill="black", font=font)
    return np.asarray(image)


@pytest.fixture(scope="module")
def ocr():
    return make_reward("ocr")


def test_exact_text_scores_one(ocr):
    images = np.stack([render_text("OPEN LATE"), render_text("Coffee")])
    scores = ocr(images, ['A sign that says "OPEN LATE"', 'A mug with "coffee" on it'], [{}, {}])
    assert scores.dtype == np.float32 and scores.shape == (2,)
    np.testing.assert_allclose(scores, [1.0, 1.0], atol=1e-6)


def test_wrong_word_scores_by_edit_distance(ocr):
    # The image shows HELLO, the prompt asks for HELP: "hello" -> "help" is 2 edits (l->p, drop o), and "help" is
    # 4 characters long, so the reward is 1 - 2/4.
    scores = ocr(render_text("HELLO")[None], ['A sign that says "HELP"'], [{}])
    np.testing.assert_allclose(scores, [0.5], atol=1e-6)


def test_blank_image_scores_zero(ocr):
    blank = np.full((1, 128, 128, 3), 255, dtype=np.uint8)
    np.testing.assert_array_equal(ocr(blank, ['A sign that says "OPEN"'], [{}]), [0.0])


def test_ground_truth_in_metadata_wins_over_the_prompt(ocr):
    scores = ocr(render_text("SALE")[None], ['A sign that says "CLOSED"'], [{"ground_truth": "sale"}])
    np.testing.assert_allclose(scores, [1.0], atol=1e-6)


def test_sample_without_target_fails_with_a_logged_reason(ocr, caplog):
    images = np.stack([render_text("EXIT"), render_text("EXIT")])
    with caplog.at_level(logging.WARNING):
        scores = ocr(images, ["a sign with no quoted text", 'a sign that says "EXIT"'], [{}, {}])
    assert np.isnan(scores[0]) and scores[1] == pytest.approx(1.0)
    assert "no text to check" in caplog.text


def test_small_images_are_read(ocr):
    scores = ocr(render_text("STOP", size=64)[None], ['a sign that says "STOP"'], [{}])
    np.testing.assert_allclose(scores, [1.0], atol=1e-6)


def test_one_engine_per_process_and_settings():
    from diffusion_rl.rewards import ocr as ocr_module

    a, b = make_reward("ocr"), make_reward("ocr")
    c = make_reward("ocr", det_limit_side_len=640)
    assert ocr_module._engine(a._settings) is ocr_module._engine(b._settings)
    assert ocr_module._engine(a._settings) is not ocr_module._engine(c._settings)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"det_limit_type": "side"}, "det_limit_type"),
        ({"det_limit_side_len": 8}, "det_limit_side_len"),
        ({"min_confidence": 2.0}, "min_confidence"),
        ({"det_limit": 320}, "accepted"),
    ],
)
def test_bad_kwargs_are_user_errors(kwargs, message):
    with pytest.raises(UserError, match=message):
        make_reward("ocr", **kwargs)
