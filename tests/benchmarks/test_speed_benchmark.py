"""benchmarks/speed.py runs end to end on the small tiny model (it broke once when the worker's API moved under it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_speed_benchmark_runs_and_reports_its_ratios(tmp_path):
    out = tmp_path / "speed.json"
    command = [sys.executable, str(ROOT / "benchmarks/speed.py"), "--preset", "small", "--batch", "2", "--steps", "3",
               "--size", "32", "--repeats", "1", "--e2e-steps", "1", "--threads", "1", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["sampler"]["ratio"] > 0 and result["update"]["ratio"] > 0
    assert result["end_to_end"]["images_per_second"] > 0
