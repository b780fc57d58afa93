"""Ctrl-C ends a training run with one line — how many steps were done, the last checkpoint — and status 130, not a
KeyboardInterrupt traceback; the same command then resumes from that checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ctrl_c_during_a_run_says_where_it_stopped_and_what_was_saved(train_argv, tmp_path):
    argv = train_argv("train.total_steps=100000", "train.save_every=1", "train.keep_last=1")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-m", "diffusion_rl.cli", *argv],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background shell ignores it otherwise
    )
    latest = tmp_path / "run" / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not latest.is_file() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)  # a first checkpoint saved: the run is in its loop
    assert child.poll() is None, child.communicate()
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = err.strip().splitlines()[-1]
    checkpoint = tmp_path / "run" / "checkpoints" / latest.read_text().strip()
    assert last.startswith("diffusion-rl: stopped: interrupted (Ctrl-C) with ") and " of 100000 steps done; " in last
    assert f"the last checkpoint is {checkpoint} (step {int(checkpoint.name[5:])}): run the same command" in last


def test_ctrl_c_in_any_other_command_is_one_line(monkeypatch, capsys):
    import diffusion_rl.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_config", interrupted)
    assert cli.main(["config", "reference"]) == 130
    assert capsys.readouterr().err == "diffusion-rl: interrupted (Ctrl-C)\n"
