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


def test_validation_points_are_drawn_raw_and_only_dense_training_curves_are_smoothed():
    from diffusion_rl.tracking.plots import plan_panels

    rows = [{"step": s, "reward/mean": float(s % 3)} for s in range(1, 21)]
    rows += [{"step": s, "val/reward/mean": 0.1 * s} for s in (0, 10, 20)]
    panels = {p.key: p for p in plan_panels(rows, ["reward/mean", "val/reward/mean"], smooth=5)}
    assert panels["reward/mean"].smooth == 5 and len(panels["reward/mean"].values) == 20
    assert panels["val/reward/mean"].smooth == 0 and panels["val/reward/mean"].values.tolist() == [0.0, 1.0, 2.0]
    # a short training curve (≤ 2 windows) is not smoothed either: a trailing mean of 5 over 8 points misleads
    short = plan_panels([r for r in rows if "reward/mean" in r and r["step"] <= 8], ["reward/mean"], smooth=5)
    assert short[0].smooth == 0


def test_constant_panels_are_skipped_on_request_and_their_value_named():
    from diffusion_rl.tracking.plots import constant_value, plan_panels

    rows = [{"step": s, "clip_fraction": 0.0, "ratio_mean": 1.0, "grad_norm": 0.5 + s} for s in range(1, 5)]
    keys = ["ratio_mean", "clip_fraction", "grad_norm"]
    assert [p.key for p in plan_panels(rows, keys)] == keys
    assert [p.key for p in plan_panels(rows, keys, skip_constant=True)] == ["grad_norm"]
    assert [constant_value(rows, k) for k in keys] == [1.0, 0.0, None]
    # one logged step says nothing of change: drawn unless it is 0
    one = [{"step": 1, "ratio_mean": 1.0, "clip_fraction": 0.0}]
    assert [p.key for p in plan_panels(one, keys, skip_constant=True)] == ["ratio_mean"]
    assert constant_value(one, "ratio_mean") is None and constant_value(one, "clip_fraction") == 0.0


def test_policy_plot_has_one_panel_per_informative_key(tmp_path):
    rows = [{"step": s, "clip_fraction": 0.0, "grad_norm": 0.5 + s, "loss": 0.1 * s} for s in range(1, 5)]
    few = plot_metrics(rows, tmp_path / "few.png", ["clip_fraction", "grad_norm", "loss"], skip_constant=True)
    all_ = plot_metrics(rows, tmp_path / "all.png", ["clip_fraction", "grad_norm", "loss"])
    assert Image.open(few).size[1] < Image.open(all_).size[1]  # 2 stacked panels instead of 3


def test_fixed_margins_in_inches_and_every_label_inside_the_figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from diffusion_rl.tracking.plots import _margins

    for n in (1, 3):
        height = 2.6 * n
        fig = Figure(figsize=(8, height))
        canvas = FigureCanvasAgg(fig)
        axes = fig.subplots(n, 1, sharex=True, squeeze=False, gridspec_kw=_margins(n))[:, 0]
        boxes = [ax.get_position() for ax in axes]  # figure fractions, top panel first
        assert math.isclose(boxes[0].x0 * 8, 0.85) and math.isclose((1 - boxes[0].x1) * 8, 0.2)
        assert math.isclose((1 - boxes[0].y1) * height, 0.35) and math.isclose(boxes[-1].y0 * height, 0.55)
        for upper, lower in zip(boxes, boxes[1:]):
            assert math.isclose((upper.y0 - lower.y1) * height, 0.45)
        for ax in axes:  # wide tick labels, a title, the step label: all drawn inside the canvas
            ax.plot([0, 1000], [-0.00123, 1234.5])
            ax.set_title("val/reward/mean")
        axes[-1].set_xlabel("step")
        canvas.draw()
        for ax in axes:  # what is drawn of each panel: its tick labels, title and axis label
            box = ax.get_tightbbox(canvas.get_renderer())
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height, box
