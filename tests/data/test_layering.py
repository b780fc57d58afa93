"""Data never imports rewards (rewards may import data): the dependency points one way only."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "diffusion_rl" / "data"
MODULES = sorted("diffusion_rl.data" + ("" if p.stem == "__init__" else f".{p.stem}") for p in DATA.glob("*.py"))


def test_no_data_module_mentions_rewards_in_an_import():
    offenders = []
    for path in sorted(DATA.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # function-level imports too
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if n.startswith("diffusion_rl.rewards")]
    assert not offenders, offenders


def test_importing_every_data_module_loads_no_rewards_module():
    code = (
        "import importlib, json, sys\n"
        f"for name in {MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('diffusion_rl.'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(MODULES) - {"diffusion_rl.data"} <= set(loaded)  # the check ran on every module
    assert not [m for m in loaded if m.startswith("diffusion_rl.rewards")], loaded
