"""README's test command runs the suite in two xdist workers, and the tests that start a Ray cluster in one of them
(`--dist loadgroup`: tests/conftest.py groups the tests that use a fixture of RAY_CLUSTER_FIXTURES). A cluster started
anywhere else would run beside another on the 2 cores; this test finds every place in tests/ that starts one."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
STARTS_A_CLUSTER = {("ray", "init"), (None, "Cluster")}  # ray.init(...), ray.cluster_utils.Cluster(...)


def cluster_fixtures_in_conftest() -> set[str]:
    for node in ast.parse((TESTS / "conftest.py").read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["RAY_CLUSTER_FIXTURES"]:
            return set(ast.literal_eval(node.value))
    raise AssertionError("tests/conftest.py has no RAY_CLUSTER_FIXTURES")


def starts_a_cluster(function: ast.FunctionDef) -> bool:
    for node in ast.walk(function):
        f = node.func if isinstance(node, ast.Call) else None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in STARTS_A_CLUSTER:
            return True
        if isinstance(f, ast.Name) and (None, f.id) in STARTS_A_CLUSTER:
            return True
    return False


def is_fixture(function: ast.FunctionDef) -> bool:
    return any("fixture" in ast.unparse(d) for d in function.decorator_list)


def cluster_starters() -> dict[str, list[str]]:
    """file → the fixtures and tests in it that start a cluster themselves (helpers that no test calls left out)."""
    found: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            tested = isinstance(node, ast.FunctionDef) and (is_fixture(node) or node.name.startswith("test_"))
            if tested and starts_a_cluster(node):
                found.setdefault(str(path.relative_to(TESTS)), []).append(node.name)
    return found


def test_every_fixture_that_starts_a_ray_cluster_is_in_the_ray_group():
    grouped = cluster_fixtures_in_conftest()
    starters = cluster_starters()
    assert starters, "no place in tests/ starts a Ray cluster: the scan is broken"
    outside = {f"{file}::{name}" for file, names in starters.items() for name in names if name not in grouped}
    assert not outside, f"these start a Ray cluster outside tests/conftest.py's RAY_CLUSTER_FIXTURES: {outside}"
    assert {name for names in starters.values() for name in names} == grouped, "a grouped fixture starts no cluster"


def test_the_scan_finds_a_cluster_started_by_a_test(tmp_path):
    code = "import ray\n\ndef test_mine():\n    ray.init(num_cpus=2)\n\n@pytest.fixture\ndef two():\n    Cluster()\n"
    functions = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef)]
    assert [starts_a_cluster(f) for f in functions] == [True, True]
    assert [is_fixture(f) for f in functions] == [False, True]
