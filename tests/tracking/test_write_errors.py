"""A write that fails (a full disk) names its file: the OSError a writer raises without a file name (PIL's,
matplotlib's, a buffered write's flush) gets the path, so the CLI's one line says which write failed."""

from __future__ import annotations

import builtins
import errno
import io
import os

import numpy as np
import pytest

from diffusion_rl.tracking.images import save_png
from diffusion_rl.tracking.jsonl import JsonlTracker
from diffusion_rl.tracking.plots import plot_metrics
from diffusion_rl.tracking.val_images import write_validation_images
from diffusion_rl.tracking.video import save_video


class _FullDisk:
    """A file whose writes fail as on a full disk: OSError(ENOSPC) with no file name."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def writelines(self, lines):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


@pytest.fixture
def fill_disk(monkeypatch):
    """fill_disk(folder): from then on, every file opened for writing under `folder` fails its writes."""
    real_open = builtins.open

    def fill(folder):
        def fake_open(file, mode="r", *args, **kwargs):
            opened = real_open(file, mode, *args, **kwargs)
            writing = any(c in mode for c in "wax+")
            inside = isinstance(file, (str, os.PathLike)) and os.fspath(file).startswith(str(folder))
            return _FullDisk(opened) if writing and inside else opened

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(io, "open", fake_open)  # pathlib's write_text/write_bytes

    return fill


def _png(path):
    save_png(np.zeros((8, 8, 3), np.uint8), path)


def _webp(path):
    save_video(np.zeros((2, 8, 8, 3), np.uint8), path)


def _plot(path):
    plot_metrics([{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.6}], path)


def _validation_index(path):
    write_validation_images(path.parent, 0, np.zeros((1, 8, 8, 3), np.uint8), ["p"], 1, np.zeros(1))


@pytest.mark.parametrize(
    "write, name",
    [(_png, "grid.png"), (_webp, "clip.webp"), (_plot, "reward.png"), (_validation_index, "samples")],
)
def test_a_failed_write_names_its_path(write, name, tmp_path, fill_disk):
    fill_disk(tmp_path)
    with pytest.raises(OSError) as error:
        write(tmp_path / name)
    assert error.value.errno == errno.ENOSPC and error.value.filename is not None
    assert os.fspath(error.value.filename).startswith(str(tmp_path)), error.value.filename


def test_a_metrics_row_that_cannot_be_written_names_the_metrics_file(tmp_path, monkeypatch):
    tracker = JsonlTracker(tmp_path)
    monkeypatch.setattr(tracker, "_file", _FullDisk(tracker._file))
    with pytest.raises(OSError) as error:
        tracker.log_metrics({"loss": 1.0}, step=1)
    assert error.value.filename == str(tmp_path / "metrics.jsonl")


def test_a_full_disk_at_the_validation_grid_is_one_line_naming_it(train_argv, tmp_path, fill_disk, capsys):
    from diffusion_rl.cli import main

    fill_disk(tmp_path / "run" / "samples")

    assert main(train_argv("val.before_train=true", "log.tensorboard=false")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    grid = tmp_path / "run" / "samples" / "step_000000.png"
    assert err[-1] == f"diffusion-rl: error: {grid}: No space left on device", err
