"""scripts/install.sh against a fake Python environment: which torch it keeps or installs, what it pins, and that
it never imports torch (on a fresh machine that prints "Failed to initialize NumPy" before numpy is installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# `python -m pip …` is logged (constraint files with their contents) and "installs" a torch==X by writing its
# metadata; anything else runs the real interpreter without site-packages, on the fake site only
FAKE_PYTHON = r"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  shift 2
  echo "pip $*" >>"$FAKE_LOG"
  prev=""
  for arg in "$@"; do
    if [ "$prev" = "-c" ]; then echo "constraints: $(cat "$arg")" >>"$FAKE_LOG"; fi
    case "$arg" in torch==*) "$REAL_PYTHON" "$FAKE_TORCH" "$FAKE_SITE" "${arg#torch==}";; esac
    prev="$arg"
  done
  exit 0
fi
PYTHONPATH="$FAKE_SITE" exec "$REAL_PYTHON" -S "$@"
"""

# a torch whose import says what a real one says when numpy is missing, and leaves a mark
MAKE_TORCH = """import pathlib, sys
site, version = pathlib.Path(sys.argv[1]), sys.argv[2]
info = site / f"torch-{version}.dist-info"
info.mkdir(parents=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\\nName: torch\\nVersion: {version}\\n")
(site / "torch").mkdir()
(site / "torch" / "__init__.py").write_text(
    "import pathlib, sys\\n"
    f"pathlib.Path({str(site / 'IMPORTED')!r}).touch()\\n"
    "sys.stderr.write('UserWarning: Failed to initialize NumPy: No module named numpy\\\\n')\\n"
    f"__version__ = {version!r}\\n"
)
"""


@pytest.fixture
def fake_env(tmp_path):
    site, log = tmp_path / "site", tmp_path / "pip.log"
    site.mkdir()
    (tmp_path / "make_torch.py").write_text(MAKE_TORCH)
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "REAL_PYTHON": sys.executable, "FAKE_SITE": str(site),
           "FAKE_LOG": str(log), "FAKE_TORCH": str(tmp_path / "make_torch.py")}  # fmt: skip
    env.pop("TORCH_SPEC", None)
    env.pop("TORCH_INDEX_URL", None)

    def run(*args: str) -> tuple[str, list[str]]:
        done = subprocess.run(["bash", str(ROOT / "scripts/install.sh"), *args], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout + done.stderr, log.read_text().splitlines() if log.exists() else []

    return site, run


def test_an_installed_torch_is_kept_pinned_and_never_imported(fake_env):
    site, run = fake_env
    subprocess.run([sys.executable, str(site.parent / "make_torch.py"), str(site), "2.13.0+cu128"], check=True)
    output, pip = run("dev")
    assert len(pip) == 2  # no torch install: the rest only, pinned to the installed build
    assert pip[0].startswith("pip install -q -c ") and pip[0].endswith(" -e .[dev]")
    assert pip[1] == "constraints: torch==2.13.0+cu128"
    assert "diffusion-rl installed (torch 2.13.0+cu128)" in output
    assert "NumPy" not in output and not (site / "IMPORTED").exists()


def test_a_fresh_machine_gets_torch_first_then_the_rest_pinned_to_it(fake_env):
    site, run = fake_env
    output, pip = run()
    assert pip[0] == "pip install -q torch==2.13.0"  # on its own, before anything that needs numpy
    assert pip[1].startswith("pip install -q -c ") and pip[1].endswith(" -e .")
    assert pip[2] == "constraints: torch==2.13.0"
    assert "NumPy" not in output and not (site / "IMPORTED").exists()
