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


# config/ is the ground (docs/architecture.md): it imports none of the layers above it. What it still reaches, to
# be found through the registries at validation instead (issue 43 item 8): the loss registry, the model families
# and attention backends, the guard's section. Nothing may be added to this list.
CONFIG_STILL_REACHES = {
    ("config/algorithm.py", "diffusion_rl.algorithms"),
    ("config/model.py", "diffusion_rl.models.attention"),
    ("config/model.py", "diffusion_rl.models.registry"),
    ("config/__init__.py", "diffusion_rl.guard.config"),
}


def test_config_imports_no_layer_above_it():
    above = ("algorithms", "models", "guard", "engine", "trainer", "evaluation", "rewards", "sampling", "data",
             "checkpoint", "commands", "estimate", "pretrain", "tracking")  # fmt: skip
    found = set()
    for path in sorted((PACKAGE / "config").rglob("*.py")):
        for _, module in _imports(path):
            if _layer(module) in above:
                found.add((str(path.relative_to(PACKAGE)), _module_of(module)))
    assert found <= CONFIG_STILL_REACHES, sorted(found - CONFIG_STILL_REACHES)


def test_the_engine_reads_no_dataset():
    """Workers get the run's texts in their spec (engine/spec.py): the trainer reads the prompts, once."""
    readers = {"diffusion_rl.data.prompts", "diffusion_rl.data.pairs"}
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
             for path in sorted((PACKAGE / "engine").rglob("*.py"))
             for line, module in _imports(path) if _module_of(module) in readers]  # fmt: skip
    assert not found, "\n".join(found)


def test_checkpoint_paths_is_a_leaf():
    imported = {m for _, m in _imports(PACKAGE / "checkpoint" / "paths.py")}
    assert imported <= {"diffusion_rl.errors", "diffusion_rl.errors.UserError"}, imported


def test_no_file_in_the_package_is_over_600_lines():
    """Small files with one job: a module past 600 lines is split by what it does (docs/architecture.md)."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > 600:
            long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    assert not long, "over 600 lines:\n" + "\n".join(long)


def test_config_io_is_a_leaf():
    """The loader works for any dataclass tree (the run config, pretraining's, a loss's settings): it imports only
    itself and diffusion_rl.errors, so loading a config never pulls in the sections' dependencies."""
    imported = {m for path in (PACKAGE / "config_io").rglob("*.py") for _, m in _imports(path)}
    assert all(m.startswith(("diffusion_rl.config_io.", "diffusion_rl.errors")) for m in imported), imported


def _module_of(name: str) -> str | None:
    """The diffusion_rl module (file or package) an imported name lives in: the longest prefix that is one."""
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        base = PACKAGE.parent.joinpath(*parts[:end])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return ".".join(parts[:end])
    return None


def test_no_import_circle_between_modules():
    """No module reaches itself through imports, function-level ones included (a lazy import hides a circle, it does
    not remove it); `if TYPE_CHECKING:` imports are hints, not dependencies."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        targets = {_module_of(name) for _, name in _imports(path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    # Tarjan's strongly connected components: a component of more than one module is a circle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)
