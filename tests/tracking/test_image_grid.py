import numpy as np
import pytest
from PIL import Image

from diffusion_rl.tracking import image_grid, save_png
from diffusion_rl.tracking.images import GAP


def _tiles(count, size):
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(count, size, size, 3), dtype=np.uint8)


def test_grid_without_captions_has_the_tiles_side_by_side():
    tiles = _tiles(6, 128)
    grid = image_grid(tiles, ncols=3)
    assert grid.dtype == np.uint8
    assert grid.shape == (2 * 128 + GAP, 3 * 128 + 2 * GAP, 3)
    np.testing.assert_array_equal(grid[:128, :128], tiles[0])
    np.testing.assert_array_equal(grid[128 + GAP :, 128 + GAP : 256 + GAP], tiles[4])


def test_tiny_tiles_are_upscaled_with_nearest_so_captions_fit():
    tiles = _tiles(3, 32)
    grid = image_grid(list(tiles), captions=["a", "b", "c"], ncols=3)
    assert grid.shape[1] == 3 * 128 + 2 * GAP  # 32 px tiles scaled by 4
    np.testing.assert_array_equal(grid[:128:4, :128:4], tiles[0])
    np.testing.assert_array_equal(grid[1:128:4, 1:128:4], tiles[0])


def test_captions_add_a_band_with_text_in_it():
    tiles = np.zeros((2, 64, 64, 3), dtype=np.uint8)
    blank = image_grid(tiles, captions=["", ""], caption_height=40)
    labelled = image_grid(tiles, captions=["reward 0.93", "a very long prompt " * 20], caption_height=40)
    assert blank.shape == labelled.shape == (128 + 40, 2 * 128 + GAP, 3)
    assert (blank[128:] == 255).all()  # empty captions: the band stays white
    for col in range(2):
        band = labelled[128:, col * (128 + GAP) : col * (128 + GAP) + 128]
        assert (band < 128).any(), f"no text drawn under tile {col}"


def test_default_caption_band_grows_with_wrapped_lines_up_to_a_limit():
    tiles = np.zeros((1, 256, 256, 3), dtype=np.uint8)
    one_line = image_grid(tiles, captions=["short"])
    many_lines = image_grid(tiles, captions=["word " * 200])
    assert 256 < one_line.shape[0] < many_lines.shape[0] < 256 + 200


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        image_grid(_tiles(2, 32), captions=["x"])
    with pytest.raises(ValueError, match="uint8"):
        image_grid(np.zeros((2, 32, 32, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="one size"):
        image_grid([np.zeros((32, 32, 3), np.uint8), np.zeros((16, 16, 3), np.uint8)])


def test_save_png_creates_parent_folders_and_round_trips(tmp_path):
    array = _tiles(1, 40)[0]
    path = save_png(array, tmp_path / "a" / "b" / "grid.png")
    np.testing.assert_array_equal(np.asarray(Image.open(path)), array)
