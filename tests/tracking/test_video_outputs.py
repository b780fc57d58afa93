"""Videos a person can look at: animated WebP/GIF files read back frame for frame, MP4 with imageio-ffmpeg, video
grids, sample sheets with sources, and videos in TensorBoard and W&B."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diffusion_rl.errors import UserError
from diffusion_rl.tracking import TensorBoardTracker, WandbTracker
from diffusion_rl.tracking.media import sample_sheet, save_sample, with_sources
from diffusion_rl.tracking.video import read_animation, save_video, video_grid


def moving_square(frames: int = 5, size: int = 16) -> np.ndarray:
    """uint8 [F, size, size, 3]: a red 4×4 square moving one pixel right per frame on black."""
    video = np.zeros((frames, size, size, 3), dtype=np.uint8)
    for f in range(frames):
        video[f, 6:10, 2 + f : 6 + f] = (255, 0, 0)
    return video


@pytest.mark.parametrize("suffix", [".webp", ".gif"])
def test_animations_keep_every_frame(tmp_path, suffix):
    video = moving_square()
    path = save_video(video, tmp_path / f"v{suffix}", fps=4)
    frames = read_animation(path)
    assert frames.shape == video.shape
    assert np.array_equal(frames, video)  # lossless WebP; the GIF palette holds red and black exactly
    with Image.open(path) as animation:
        assert animation.n_frames == 5 and animation.info["loop"] == 0  # endless
        if suffix == ".gif":
            assert animation.info["duration"] == 250  # ms a frame at 4 fps


def test_mp4_needs_imageio_ffmpeg_and_says_so(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    with pytest.raises(UserError, match="pip install imageio-ffmpeg"):
        save_video(moving_square(), tmp_path / "v.mp4")
    with pytest.raises(UserError, match="use .webp, .gif or .mp4"):
        save_video(moving_square(), tmp_path / "v.avi")


def test_mp4_with_imageio_ffmpeg(tmp_path):
    ffmpeg = pytest.importorskip("imageio_ffmpeg")
    path = save_video(moving_square(frames=6, size=15), tmp_path / "v.mp4")  # odd sides are padded for H.264
    reader = ffmpeg.read_frames(str(path))
    meta = next(reader)
    assert tuple(meta["size"]) == (16, 16) and sum(1 for _ in reader) == 6


def test_video_grid_is_the_image_grid_of_each_frame():
    videos = np.stack([moving_square(), moving_square()[::-1]])
    grid = video_grid(videos, ["forward", "backward"], ncols=2)
    assert grid.shape[0] == 5 and grid.ndim == 4
    assert not np.array_equal(grid[0], grid[4])  # the frames move
    assert np.array_equal(sample_sheet(videos, ["forward", "backward"], 2), grid)


def test_edit_tiles_show_the_sources_then_the_result(tmp_path):
    result = np.full((1, 8, 8, 3), 200, dtype=np.uint8)
    source = np.zeros((8, 8, 3), dtype=np.uint8)
    tiles = with_sources(result, [[source]])
    assert tiles.shape == (1, 8, 8 + 2 + 8, 3)  # source | 2 px bar | result
    assert (tiles[0, :, :8] == 0).all() and (tiles[0, :, 8:10] == 255).all() and (tiles[0, :, 10:] == 200).all()
    assert save_sample(tiles[0], tmp_path / "tile").name == "tile.png"
    assert save_sample(moving_square(), tmp_path / "clip").name == "clip.webp"


def test_a_videos_tiles_hold_its_first_frame_still_beside_every_frame():
    videos = moving_square()[None]  # [1, 5, 16, 16, 3]: an image-to-video's result
    source = np.full((16, 16, 3), 7, dtype=np.uint8)
    tiles = with_sources(videos, [[source]])
    assert tiles.shape == (1, 5, 16, 16 + 2 + 16, 3)
    assert (tiles[0, :, :, :16] == 7).all() and (tiles[0, :, :, 16:18] == 255).all()
    assert np.array_equal(tiles[0, :, :, 18:], videos[0])
    assert sample_sheet(videos, ["a"], 1, [[source]]).ndim == 4  # a video sheet


def test_tensorboard_shows_a_video_as_an_animated_gif(tmp_path):
    tracker = TensorBoardTracker(tmp_path)
    tracker.log_video("val/samples", moving_square(), step=3, caption="moving")
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    (picture,) = events.Images("val/samples")
    assert (picture.step, picture.width, picture.height) == (3, 16, 16)
    with Image.open(io.BytesIO(picture.encoded_image_string)) as gif:
        assert gif.format == "GIF" and gif.n_frames == 5


def test_wandb_logs_a_video(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(project="diffusion-rl-test", name="video", run_dir=tmp_path, mode="offline")
    tracker.log_video("val/samples", moving_square(), step=1, caption="moving")
    tracker.close()
    (run_folder,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(run_folder.rglob("*.gif")), "the logged video was not written"
