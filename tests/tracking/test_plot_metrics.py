import math

import numpy as np
from PIL import Image

from diffusion_rl.tracking import plot_metrics
from diffusion_rl.tracking.plots import moving_average


def test_plot_writes_a_png_for_the_keys_present(tmp_path):
    rows = [{"step": s, "reward/mean": math.sin(s / 5)} for s in range(1, 40)]
    rows += [{"step": s, "val/reward/mean": 0.1 * s} for s in range(0, 40, 10)]
    rows.append({"step": 40, "reward/mean": None})  # non-finite values come back from JSONL as null
    out = plot_metrics(rows, tmp_path / "plots" / "curves.png")
    assert out == tmp_path / "plots" / "curves.png"
    width, height = Image.open(out).size
    assert height > width / 2  # two stacked subplots


def test_nothing_to_plot_writes_no_file(tmp_path):
    out = tmp_path / "curves.png"
    assert plot_metrics([{"step": 1, "loss": 0.5}], out) is None
    assert not out.exists()


def test_moving_average_is_a_trailing_mean():
    np.testing.assert_allclose(moving_average(np.array([1.0, 3.0, 5.0, 7.0]), 2), [1.0, 2.0, 4.0, 6.0])
    np.testing.assert_allclose(moving_average(np.array([1.0, 3.0]), 1), [1.0, 3.0])
