"""Loading a benchmark script (benchmarks/ is no package) as a module."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def load_benchmark():
    """load_benchmark("learning") → benchmarks/learning.py as a module."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"{name}_benchmark", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
