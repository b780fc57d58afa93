import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diffusion_rl.tracking import TensorBoardTracker


def _load(log_dir):
    accumulator = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_scalars_images_and_captions_land_in_event_files(tmp_path):
    tracker = TensorBoardTracker(tmp_path)
    tracker.log_metrics({"reward/mean": 0.5}, step=1)
    tracker.log_metrics({"reward/mean": 0.75}, step=2)
    image = np.zeros((8, 12, 3), dtype=np.uint8)
    image[..., 0] = 255
    tracker.log_images("samples", image, step=2, caption="a red square")
    tracker.close()

    events = _load(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.5), (2, 0.75)]
    (picture,) = events.Images("samples")
    assert (picture.step, picture.width, picture.height) == (2, 12, 8)
    (text,) = events.Tensors("samples/text_summary")
    assert text.step == 2
    assert text.tensor_proto.string_val[0].decode() == "a red square"


def test_resume_hides_events_after_the_resumed_step(tmp_path):
    tracker = TensorBoardTracker(tmp_path)
    for step in range(1, 6):
        tracker.log_metrics({"loss": float(step)}, step=step)
    tracker.close()

    resumed = TensorBoardTracker(tmp_path)
    resumed.resume_from(3)
    resumed.log_metrics({"loss": 40.0}, step=4)
    resumed.close()

    events = _load(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_image_of_wrong_layout_is_rejected(tmp_path):
    tracker = TensorBoardTracker(tmp_path)
    with pytest.raises(ValueError, match=r"uint8 \[H, W, 3\]"):
        tracker.log_images("x", np.zeros((3, 8, 8), dtype=np.uint8), step=0)
    tracker.close()
