"""The package's dependency arrows point one way (docs/architecture.md): checked on every import statement of every
module, lazy ones inside functions included; imports under `if TYPE_CHECKING:` are type hints, not dependencies."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "diffusion_rl"

# layer → the layers it must never import
FORBIDDEN = {
    "data": ("rewards", "models", "sampling", "algorithms", "engine", "trainer", "evaluation", "checkpoint"),
    "models": ("algorithms", "engine", "trainer", "evaluation", "rewards", "checkpoint"),
    "sampling": ("algorithms", "engine", "trainer", "evaluation", "rewards", "checkpoint"),
    "algorithms": ("models", "engine", "trainer", "evaluation", "checkpoint"),
    "engine": ("trainer", "evaluation"),
    "rewards": ("engine", "trainer", "algorithms", "models", "evaluation"),
    "checkpoint": ("engine", "trainer", "evaluation", "algorithms"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every diffusion_rl import in `path`, except those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for child in node.body for n in ast.walk(child))
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.startswith("diffusion_rl.")]
    return found


def _layer(module: str) -> str:
    return module.split(".")[1]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_never_imports_the_layers_above_it(layer):
    problems = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in _imports(path):
            if _layer(module) in FORBIDDEN[layer]:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not problems, "\n".join(problems)


def test_checkpoint_paths_is_a_leaf():
    imported = {m for _, m in _imports(PACKAGE / "checkpoint" / "paths.py")}
    assert imported <= {"diffusion_rl.errors", "diffusion_rl.errors.UserError"}, imported
